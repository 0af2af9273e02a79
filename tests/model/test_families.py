"""What the config reader refuses, by name, in the families it runs (the families' parity is in
tests/engine/test_parity.py and test_logits.py), and the split of checkpoint weights that come fused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gapless.model.config import load_model_config, model_config_from_dict
from gapless.model.cpu_gemm import ENV
from gapless.model.loader import load_model
from gapless.testing import make_checkpoint


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("phi3"), "phi3")


def _config(path: Path, **patch) -> dict:
    return {**json.loads((path / "config.json").read_text()), **patch}


_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        # Phi-3's LongRoPE (v5's rope_parameters, and v4's rope_scaling with the old "su" name)
        ({"rope_parameters": {**_LONGROPE, "rope_theta": 10000.0}}, "LongRoPE"),
        ({"rope_parameters": None, "rope_scaling": {**_LONGROPE, "type": "su"}}, "LongRoPE"),
        # a window in a family that has none in gapless (Qwen3-MoE's)
        (
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "sliding_window": 64,
                "use_sliding_window": True,
            },
            r"sliding-window attention \(sliding_window=64 < max_position_embeddings=1024\)",
        ),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        (
            {"architectures": ["Idefics3ForConditionalGeneration"], "vision_config": {"hidden_size": 8}},
            r"Idefics3ForConditionalGeneration'.*multimodal: vision_config; gapless runs text only",
        ),
        ({"architectures": ["DeepseekV2ForCausalLM"]}, "unsupported architecture 'DeepseekV2ForCausalLM'"),
        ({"architectures": ["Gemma3nForCausalLM"]}, "unsupported architecture 'Gemma3nForCausalLM'"),
        # mixture-of-experts keys in a dense family's config
        ({"num_local_experts": 8}, r"mixture-of-experts \(num_local_experts=8\) is not supported"),
        ({"architectures": ["OlmoeForCausalLM"], "clip_qkv": 8.0}, "clip_qkv=8.0 is not supported"),
        (
            {"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
            "use_bidirectional_attention=True is not supported",
        ),
        (
            {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 5},
            r"num_experts_per_tok=5 must be in 1..num_experts=4",
        ),
    ],
)
def test_unsupported_configs_are_refused_by_name(phi3: Path, patch: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_config_from_dict(_config(phi3, **patch), "config.json")
    model_config_from_dict(_config(phi3), "config.json")  # the unpatched config is accepted


def test_fused_checkpoint_weights_are_split_into_their_shards(
    phi3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Phi-3's qkv_proj and gate_up_proj load into the same q/k/v and gate/up shards as separate
    tensors would; a fused tensor of the wrong height is refused by name."""
    monkeypatch.setenv(ENV, "plain")  # the loaded weights themselves, not their CPU-packed copies
    weights = load_file(str(phi3 / "model.safetensors"))
    model = load_model(phi3, torch.float32, torch.device("cpu"))
    cfg = load_model_config(phi3)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv = weights["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(attn.qkv_proj.weight, qkv)
    off, n = attn.qkv_proj.shard_offsets["k"]
    assert (off, n) == (cfg.q_size, cfg.kv_size)
    assert torch.equal(mlp.gate_up_proj.weight, weights["model.layers.0.mlp.gate_up_proj.weight"])

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in phi3.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    save_file(
        {**weights, "model.layers.0.self_attn.qkv_proj.weight": qkv[:-1]}, str(bad / "model.safetensors")
    )
    with pytest.raises(ValueError, match="fused weight 'model.layers.0.self_attn.qkv_proj.weight'"):
        load_model(bad, torch.float32, torch.device("cpu"))


def test_the_gemma2_checkpoint_window_shapes_long_prompts(tmp_path: Path) -> None:
    """The parity tests' Gemma 2 checkpoint slides a 24-token window on layer 0: the same weights with a
    window past the prompt give the same logits up to position 24 and different ones after, so parity
    on prompts longer than 24 (tests/engine/test_parity.py, test_logits.py) checks the window."""
    from gapless.testing.hf_reference import hf_logits, load_hf_model

    windowed = load_hf_model(make_checkpoint(tmp_path / "w24", "gemma2"))
    wide = load_hf_model(make_checkpoint(tmp_path / "w1024", "gemma2", sliding_window=1024))
    ids = list(range(5, 65))
    a, b = hf_logits(windowed, ids), hf_logits(wide, ids)
    torch.testing.assert_close(a[:24], b[:24], atol=1e-5, rtol=0)
    assert (a[24:] - b[24:]).abs().amax(-1).min() > 1e-3
    cfg = load_model_config(tmp_path / "w24")
    assert (cfg.sliding_window, cfg.window_layers) == (24, (True, False))
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (4.0, 8.0)
    assert (
        cfg.attention_scale == 24**-0.5 and cfg.norms == "sandwich" and cfg.hidden_act == "gelu_pytorch_tanh"
    )


@pytest.mark.parametrize(
    ("kind", "hf_class"),
    [
        ("llama", "transformers.models.llama.modeling_llama.LlamaRMSNorm"),
        ("fp32", "transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm"),
        ("gemma", "transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm"),
    ],
)
def test_each_rms_norm_is_bit_exact_with_its_family_in_bf16(kind: str, hf_class: str) -> None:
    """Where the weight multiplies (before or after the cast back to bf16) changes bf16 results; each
    family's norm does it as transformers' does, bit for bit."""
    import importlib

    from gapless.model.layers import make_rms_norm

    module, name = hf_class.rsplit(".", 1)
    hf = getattr(importlib.import_module(module), name)(64, eps=1e-6)
    ours = make_rms_norm(64, 1e-6, kind)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, generator=g) * 0.3 + (0.0 if kind == "gemma" else 1.0)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(weight)
        ours.weight.copy_(weight)
        hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
        assert torch.equal(ours(x), hf(x))


def test_gemma3_window_layers_rotate_with_their_own_base(tmp_path: Path) -> None:
    """Gemma 3's window layers take the sliding RoPE parameters (v5's per-layer-type `rope_parameters`, v4's
    `rope_local_base_freq`, never scaled) and the global ones the rest; without `layer_types` every sixth
    layer is global. The parity checkpoint's local base matters: with the global base on both layers
    transformers' logits move, so parity (tests/engine) checks it."""
    from gapless.testing.hf_reference import hf_logits, load_hf_model

    path = make_checkpoint(tmp_path / "g3", "gemma3_text")
    cfg = load_model_config(path)
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 2.0})
    assert (cfg.local_rope_theta, cfg.local_rope_scaling) == (1e4, None)
    assert cfg.window_layers == (True, False) and cfg.qk_norm == "head" and cfg.attn_logit_softcapping is None
    v4 = {
        **_config(path, rope_parameters=None, layer_types=None, num_hidden_layers=7),
        "rope_theta": 1e6,
        "rope_local_base_freq": 5e3,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    old = model_config_from_dict(v4, "config.json")
    assert (old.rope_theta, old.rope_scaling["factor"], old.local_rope_theta) == (1e6, 8.0, 5e3)
    assert old.window_layers == (True,) * 5 + (False, True)

    same_base = tmp_path / "same"
    rope = {"rope_type": "default", "rope_theta": 1e6}
    make_checkpoint(
        same_base, "gemma3_text", rope_parameters={"sliding_attention": rope, "full_attention": rope}
    )
    ids = list(range(5, 45))
    assert (hf_logits(load_hf_model(path), ids) - hf_logits(load_hf_model(same_base), ids)).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("arch", "window", "layers"),
    [
        # Mistral (as Phi-3 and Mixtral) slides every layer once `sliding_window` is set
        ("mistral", {"sliding_window": 24}, (True, True)),
        # Qwen2 (as Qwen3) with `use_sliding_window`: the layers from `max_window_layers` on
        ("qwen2", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1}, (False, True)),
    ],
)
def test_sliding_windows_of_mistral_and_qwen_decode_as_transformers(
    tmp_path: Path, arch: str, window: dict, layers: tuple
) -> None:
    """Greedy tokens equal transformers' for prompts past the window, chunked across its edge (chunks of
    16, pages of 4), some of them on a cached prefix that ends inside it; the window changes
    transformers' logits, so the match checks it."""
    from gapless import LLM, SamplingParams
    from gapless.testing.hf_reference import check_greedy, hf_greedy, hf_logits, load_hf_model, make_prompts

    path = make_checkpoint(tmp_path / "w", arch, **window)
    assert load_model_config(path).window_layers == layers
    hf = load_hf_model(path)
    prompts = make_prompts(hf.config.vocab_size, n=6, seed=2, shared_prefix=20, max_len=60)
    wide = load_hf_model(make_checkpoint(tmp_path / "wide", arch))
    assert (hf_logits(hf, prompts[0])[30:] - hf_logits(wide, prompts[0])[30:]).abs().max() > 1e-3
    with LLM(str(path), device="cpu", dtype="float32", page_size=4, chunked_prefill_size=16) as llm:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
        assert sum(out.cached_tokens for out in outs) > 0
        llm.check_integrity()
    for prompt, out in zip(prompts, outs):
        check_greedy(out.token_ids, hf_greedy(hf, prompt, 8))

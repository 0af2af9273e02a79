"""Gemma 2, Gemma 3 and Phi-3 GGUF files (`gapless.model.gguf`), as llama.cpp's converter writes them.
Gemma: its norm names, every RMSNorm weight stored plus 1, the window and soft-caps in the metadata, the
window layers' pattern and RoPE base and the queries' scale as llama.cpp fixes them. Phi-3: q/k/v and
gate/up stored fused (`attn_qkv`, `ffn_up`), its window. The config read back is the checkpoint's; a float
file's greedy tokens are the checkpoint's under transformers, a quantized file's transformers' reading the
same file; what gapless does not compute (LongRoPE, a partial rotation) is refused by name."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.model import gguf, loader
from gapless.model.config import load_model_config
from gapless.testing.gguf_files import write_gguf
from gapless.testing.hf_reference import check_greedy, hf_greedy, load_hf_model, make_prompts

MAX_NEW = 8
# the tiny Gemmas as llama.cpp runs them: queries scaled by 1 / sqrt(head_dim) (not the 27B), Gemma 2's
# head tied (its converter drops lm_head), Gemma 3 without a final soft-cap and its window layers every
# sixth layer global (its converter writes no pattern): six layers
_TINY = {
    "phi3": dict(sliding_window=48),  # (a window every layer: Phi-3-mini's 2047 of 4096)
    "gemma2": dict(query_pre_attn_scalar=16, tie_word_embeddings=True),
    "gemma3_text": dict(
        query_pre_attn_scalar=16, final_logit_softcapping=None, num_hidden_layers=6, layer_types=None
    ),
}
# a GGUF stores the norm's epsilon in float32; the dtype is the engine's to choose
_UNSTORED = ("rms_norm_eps", "torch_dtype")


def _greedy(path, prompts) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=2048, overlap=False) as llm:
        return [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]


@pytest.mark.parametrize("arch", sorted(_TINY))
def test_a_gemma_files_config_and_float_model_are_the_checkpoints(ckpt_factory, tmp_path, arch):
    """Every config field the decoder runs by (window layers, their RoPE base, the global layers' linear
    scaling, soft-caps, the queries' scale, the norms) is the checkpoint's, and the F32 file's greedy
    tokens are transformers' on the checkpoint it was written from."""
    ckpt = ckpt_factory(arch, **_TINY[arch])
    path = write_gguf(ckpt, tmp_path / f"{arch}.F32.gguf", "F32")
    ours, theirs = load_model_config(path), load_model_config(ckpt)
    fields = [f.name for f in dataclasses.fields(ours) if f.name not in _UNSTORED]
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert ours.sliding_window is not None and any(ours.window_layers)
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    prompts = make_prompts(1000, n=3, max_len=60, shared_prefix=6)  # (past the 24-token window)
    ref = load_hf_model(ckpt)
    for out, p in zip(_greedy(path, prompts), prompts):
        assert check_greedy(out, hf_greedy(ref, p, MAX_NEW)) is None


@pytest.mark.parametrize(("arch", "qtype"), [("gemma2", "Q8_0"), ("gemma3_text", "Q4_1"), ("phi3", "Q4_0")])
def test_a_quantized_gemma_file_equals_transformers_reading_it(
    ckpt_factory, tmp_path, monkeypatch, int4_reference_path, arch, qtype
):
    """On the int4/int8 path (as a GPU runs it; the reference path, exact), greedy tokens equal
    transformers' reading the same file (given the checkpoint's config: its reader takes no soft-cap,
    window pattern or query scale), at most one near-tie."""
    from transformers import AutoConfig, AutoModelForCausalLM

    monkeypatch.setattr(loader, "gguf_kept", lambda path, device: "int4" if path.suffix == ".gguf" else "")
    ckpt = ckpt_factory(arch, **_TINY[arch])
    path = write_gguf(ckpt, tmp_path / f"{arch}.{qtype}.gguf", qtype)
    prompts = make_prompts(1000, n=3, max_len=60, shared_prefix=6)
    ours = _greedy(path, prompts)
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        config=AutoConfig.from_pretrained(ckpt),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
    notes = [check_greedy(o, hf_greedy(ref, p, MAX_NEW)) for o, p in zip(ours, prompts)]
    assert sum(n is not None for n in notes) <= 1, notes


@pytest.mark.parametrize(("arch", "layers"), [("gemma2", 46), ("gemma3_text", 62)])
def test_the_27bs_queries_are_scaled_by_hidden_over_heads(ckpt_factory, tmp_path, monkeypatch, arch, layers):
    """The file does not store `query_pre_attn_scalar`: as llama.cpp, the 27B (told by its layer count)
    scales its queries by 1 / sqrt(hidden / heads), every other size by 1 / sqrt(head_dim)."""
    path = write_gguf(ckpt_factory(arch, **_TINY[arch], head_dim=32), tmp_path / "m.gguf")
    name = gguf.metadata(path)["general.architecture"]
    assert gguf.config_dict(path)["query_pre_attn_scalar"] == 32
    meta = gguf.metadata(path) | {f"{name}.block_count": layers}
    monkeypatch.setattr(gguf, "metadata", lambda p: meta)
    assert gguf.config_dict(path)["query_pre_attn_scalar"] == 64 // 4


def test_a_fused_phi3_file_runs_the_cpus_layers(ckpt_factory, tmp_path):
    """On one CPU rank (`gguf_cpu`'s layers, the default) the fused q/k/v and gate/up are each one
    quantized layer of the file's rows; greedy tokens equal transformers' reading the file within the int8
    rounding's near-ties."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from gapless.model.quant import weights_held

    ckpt = ckpt_factory("phi3", **_TINY["phi3"])
    path = write_gguf(ckpt, tmp_path / "phi3.Q4_0.gguf", "Q4_0")
    model = loader.load_model(path, torch.float32, torch.device("cpu"))
    assert sum(weights_held(model)[0].values()) == 2 * 4 + 1  # (each layer's 4, the head)
    prompts = make_prompts(1000, n=3, max_len=60, shared_prefix=6)
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=AutoConfig.from_pretrained(ckpt), dtype=torch.float32
    ).eval()
    for out, p in zip(_greedy(path, prompts), prompts):
        check_greedy(out, hf_greedy(ref, p, MAX_NEW), tol=0.3)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            {"names": "rope_factors_long.weight"},
            "LongRoPE scaling (rope_factors_long/short) is not supported",
        ),
        ({"phi3.rope.dimension_count": 12}, "partial_rotary_factor=0.75 is not supported"),
    ],
)
def test_what_phi3_files_need_beyond_gapless_is_refused_by_name(
    ckpt_factory, tmp_path, monkeypatch, change, says
):
    """Phi-3.5's and Phi-4-mini's 128k files (LongRoPE's per-length factors) and a rotation of a head's
    first dimensions alone (Phi-4-mini): refused in one line."""
    path = write_gguf(ckpt_factory("phi3", **_TINY["phi3"]), tmp_path / "m.gguf")
    if "names" in change:
        names = gguf.tensor_names(path) | {change["names"]}
        monkeypatch.setattr(gguf, "tensor_names", lambda p: names)
    else:
        meta = gguf.metadata(path) | change
        monkeypatch.setattr(gguf, "metadata", lambda p: meta)
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        load_model_config(path)
    assert "\n" not in str(e.value)

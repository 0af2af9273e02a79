"""The test checkpoints load in transformers as written, cover the intended features, and decode well.

Everything else in the suite trusts these checkpoints as the reference, so this file checks them
against transformers itself, not against gapless.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import gapless
from gapless.default_model import tiny_model_path
from gapless.default_model.tokenizer import CORPUS, VOCAB_SIZE, trained_tokenizer_json
from gapless.testing import ARCHS, build_tokenizer, cached_checkpoint, make_checkpoint
from gapless.testing.checkpoints import model_config


def _load(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a busy machine spinning threads make
    these forwards 10x slower; the previous setting is restored for the rest of the suite."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per arch, shared by the read-only tests below."""
    return {arch: make_checkpoint(tmp_path_factory.mktemp(arch), arch) for arch in ARCHS}


# --- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_is_deterministic() -> None:
    # Each training run uses fresh Rust hash maps with new random seeds, so two runs in one
    # process are as independent as two processes.
    first = trained_tokenizer_json.__wrapped__()
    assert first == trained_tokenizer_json.__wrapped__() == trained_tokenizer_json()
    tok = build_tokenizer()
    assert len(tok) == VOCAB_SIZE
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]


def test_tokenizer_round_trips_through_save(tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    split_chars = 0
    for line in CORPUS:
        ids = tok.encode(line)
        assert loaded.encode(line) == ids
        assert max(ids) < len(tok)
        assert tok.decode(ids) == line
        assert loaded.decode(ids) == line
        split_chars += sum("\ufffd" in tok.decode([i]) for i in ids)
    # Some multi-byte characters are split across tokens, so detokenizer tests have material.
    assert split_chars > 10
    text = "unseen: 🦜 ᚠᛇᚻ ʕ•ᴥ•ʔ"
    assert loaded.decode(loaded.encode(text)) == text


def test_chat_template_renders(tmp_path: Path) -> None:
    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "café? 😀"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\ncafé? 😀<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = tok.apply_chat_template(messages, tokenize=False)
    assert not plain.endswith("assistant\n") and text.startswith(plain)
    ids = tok.encode(text)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 2


# --- checkpoints -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads_in_transformers(checkpoints: dict[str, Path], arch: str) -> None:
    path = checkpoints[arch]
    assert (path / "model.safetensors").is_file()
    assert not list(path.glob("*.bin"))
    model = _load(path)
    cfg = model.config
    assert cfg.model_type == arch
    assert cfg.max_position_embeddings == 1024

    tok = AutoTokenizer.from_pretrained(path)
    ref = build_tokenizer()
    assert tok.get_vocab() == ref.get_vocab()
    assert tok.encode(CORPUS[-1]) == ref.encode(CORPUS[-1])
    assert max(tok.get_vocab().values()) < cfg.vocab_size
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert GenerationConfig.from_pretrained(path).eos_token_id == tok.eos_token_id

    attn = model.model.layers[0].self_attn
    if arch == "phi3":  # q/k/v (and gate/up) written fused, as Phi-3 checkpoints are
        assert attn.qkv_proj.weight.shape[0] == cfg.hidden_size * 2  # 4 q + 2 kv + 2 kv heads of 16
        assert model.model.layers[0].mlp.gate_up_proj.weight.shape[0] == 2 * cfg.intermediate_size
        q, k = cfg.hidden_size, cfg.hidden_size // 2
    else:
        q, k = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == cfg.tie_word_embeddings == (arch in ("qwen2", "qwen3", "granite"))
    if arch == "olmo2":  # q/k norm over all heads; norms after attention and MLP, none before
        assert (attn.q_norm.weight.shape[0], attn.k_norm.weight.shape[0]) == (q, k)
        assert hasattr(model.model.layers[0], "post_feedforward_layernorm")
    if arch == "granite":
        assert (cfg.embedding_multiplier, cfg.residual_multiplier) == (2.0, 1.5)
        assert (cfg.attention_multiplier, cfg.logits_scaling) == (0.2, 1.25)
    if arch == "gemma2":  # a window shorter than the test prompts on layer 0, a global layer 1
        assert (cfg.sliding_window, cfg.layer_types) == (24, ["sliding_attention", "full_attention"])
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (4.0, 8.0)
        assert (cfg.query_pre_attn_scalar, cfg.hidden_activation) == (24, "gelu_pytorch_tanh")
    if arch == "llama":
        assert (q // cfg.head_dim, k // cfg.head_dim) == (4, 2)  # grouped-query
    if arch == "mistral":
        assert k // cfg.head_dim == 1 and cfg.sliding_window is None  # multi-query, full attention
    if arch == "qwen2":
        assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    if arch == "qwen3":
        assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_attention_heads
        assert attn.q_norm.weight.shape == (32,)


def test_llama3_rope_scaling_is_saved_and_used(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["llama"]
    saved = json.loads((path / "config.json").read_text())["rope_parameters"]
    expected = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=256,
        rope_theta=10000.0,
    )
    assert saved == expected
    model = _load(path)
    assert model.config.rope_parameters == expected
    rotary = model.model.rotary_emb
    assert rotary.rope_type == "llama3"
    dim = model.config.head_dim
    plain = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ratio = (plain / rotary.inv_freq).tolist()
    # head_dim 16 with these thresholds lands frequencies in all three llama3 bands.
    assert any(math.isclose(r, 1.0, rel_tol=1e-5) for r in ratio)
    assert any(math.isclose(r, 8.0, rel_tol=1e-5) for r in ratio)
    assert any(1.0 + 1e-3 < r < 8.0 - 1e-3 for r in ratio)


def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    single = make_checkpoint(tmp_path / "single", "llama", seed=3)
    sharded = make_checkpoint(tmp_path / "sharded", "llama", seed=3, shards=3)
    files = sorted(p.name for p in sharded.glob("model-*-of-*.safetensors"))
    assert len(files) >= 2
    assert not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    a, b = _weights(_load(single)), _weights(_load(sharded))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_seed_and_dtype(tmp_path: Path) -> None:
    a = _weights(_load(make_checkpoint(tmp_path / "a", "qwen3", seed=1)))
    b = _weights(_load(make_checkpoint(tmp_path / "b", "qwen3", seed=1)))
    c = _weights(_load(make_checkpoint(tmp_path / "c", "qwen3", seed=2)))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])

    path = make_checkpoint(tmp_path / "bf16", "qwen3", seed=1, dtype=torch.bfloat16)
    with safe_open(path / "model.safetensors", "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
    assert emb.dtype == torch.bfloat16
    assert torch.equal(emb, a["model.embed_tokens.weight"].to(torch.bfloat16))


def test_larger_sizes_and_overrides() -> None:
    bench = model_config("qwen3", "bench")
    assert (bench.hidden_size, bench.num_hidden_layers, bench.intermediate_size) == (512, 8, 1536)
    assert (bench.num_attention_heads, bench.num_key_value_heads, bench.head_dim) == (8, 4, 64)
    overlap = model_config("qwen3", "overlap")
    assert (overlap.hidden_size, overlap.num_hidden_layers) == (128, 2)
    assert (overlap.num_attention_heads, overlap.num_key_value_heads) == (4, 2)
    assert model_config("mistral", num_hidden_layers=3, vocab_size=1024).num_hidden_layers == 3
    with pytest.raises(ValueError):
        model_config("qwen3", vocab_size=10)
    with pytest.raises(ValueError):
        model_config("gpt2")


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_have_clear_winners(checkpoints: dict[str, Path], arch: str) -> None:
    """Greedy parity tests need a well-separated top-1 and non-degenerate continuations."""
    model = _load(checkpoints[arch])
    gen = torch.Generator().manual_seed(1234)
    prompts = torch.randint(3, model.config.vocab_size, (8, 32), generator=gen)
    with torch.no_grad():
        top2 = model(prompts).logits.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).flatten()
    assert gap.median() > 0.05
    assert (gap < 1e-3).float().mean() < 0.01

    ids = prompts[:, :16]
    with torch.no_grad():
        for _ in range(32):  # plain greedy with full recompute: no cache, no eos stopping
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    distinct = [len(set(row[16:].tolist())) for row in ids]
    assert sum(d >= 5 for d in distinct) >= 7, distinct


# --- cache -------------------------------------------------------------------------------------


def test_default_model_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GAPLESS_CACHE", str(tmp_path))
    path = tiny_model_path()
    assert path == tmp_path / "models" / "tiny-qwen3-v1"
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3"
    stamp = (path / "config.json").stat().st_mtime_ns
    assert tiny_model_path() == path
    assert (path / "config.json").stat().st_mtime_ns == stamp  # not rebuilt
    # the default model is the tiny qwen3 test checkpoint: one recipe serves both
    ref = make_checkpoint(tmp_path / "ref", "qwen3")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).read_bytes() == (ref / name).read_bytes(), name


@pytest.mark.slow  # (fresh interpreters, ~7 s)
def test_the_server_and_the_engine_do_not_import_the_test_machinery() -> None:
    code = (
        "import sys, gapless.server.launch, gapless.server.workers.scheduler_loop, "
        "gapless.server.workers.text_worker, gapless.default_model, gapless.chat, "
        "gapless.llm; print(sorted(m for m in sys.modules if m.startswith('gapless.testing')))"
    )
    root = str(Path(gapless.__file__).parents[1])  # this checkout's gapless, whatever is installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    ).stdout
    assert out.strip() == "[]"


def test_cached_checkpoint_keys_and_concurrency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GAPLESS_CACHE", str(tmp_path))
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: cached_checkpoint("mistral", seed=5), range(4)))
    assert len(set(paths)) == 1 and (paths[0] / "model.safetensors").is_file()
    # The racers' temp dirs are gone; only the winner remains.
    assert os.listdir(tmp_path / "models") == [paths[0].name]
    assert cached_checkpoint("mistral", seed=5) == paths[0]
    others = {
        cached_checkpoint("mistral", seed=6),
        cached_checkpoint("mistral", seed=5, num_hidden_layers=3),
        cached_checkpoint("qwen2", seed=5),
    }
    assert paths[0] not in others and len(others) == 3

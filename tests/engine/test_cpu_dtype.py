"""bfloat16 and float16 on the CPU: greedy tokens agree with transformers' float32 within the precision's
tolerance (a divergence only where the reference's top-2 logits are closer than that precision's error, as
the GPU's bf16 parity test allows), and the start-up says so where the CPU lacks native support for it."""

from __future__ import annotations

import logging

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.engine import cpu_dtype
from gapless.testing.hf_reference import check_greedy, hf_greedy, load_hf_model, make_prompts

MAX_TOKENS = [6, 9, 4, 8, 7, 5]


@pytest.mark.parametrize(
    ("arch", "dtype"), [("llama", "bfloat16"), ("qwen3", "bfloat16"), ("llama", "float16")]
)
def test_low_precision_greedy_parity_on_cpu(ckpt_factory, caplog, arch: str, dtype: str) -> None:
    path = ckpt_factory(arch)
    hf = load_hf_model(path)
    prompts = make_prompts(hf.config.vocab_size, n=len(MAX_TOKENS), seed=6)
    refs = [hf_greedy(hf, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    with caplog.at_level(logging.WARNING, logger="gapless.engine.runner"):
        with LLM(str(path), device="cpu", dtype=dtype, kv_cache_tokens=2048, page_size=16) as llm:
            assert llm.engine.runner is None or llm.engine.runner.dtype == getattr(torch, dtype)
            outs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            llm.check_integrity()
    for out, ref in zip(outs, refs):
        check_greedy(out, ref, tol=0.1)  # logits of std ~2; bf16 keeps 8 bits of mantissa
    slow = cpu_dtype.slow_dtype_warning(getattr(torch, dtype))
    assert (slow is not None) == any("converts to float32 on the fly" in r.message for r in caplog.records)


def test_slow_dtype_warning_names_what_the_cpu_lacks(monkeypatch) -> None:
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False)
    monkeypatch.setattr(cpu_dtype, "_cpu_flags", lambda: set())
    bf16 = cpu_dtype.slow_dtype_warning(torch.bfloat16)
    assert bf16 is not None and "without AVX512-BF16 or AMX" in bf16 and "--dtype float32" in bf16
    fp16 = cpu_dtype.slow_dtype_warning(torch.float16)
    assert fp16 is not None and "AMX-FP16 or AVX512-FP16" in fp16 and "bfloat16" not in fp16
    # a CPU with bf16 but no fp16 points a float16 user at bfloat16
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert cpu_dtype.slow_dtype_warning(torch.bfloat16) is None
    assert "or bfloat16, which this CPU has" in (cpu_dtype.slow_dtype_warning(torch.float16) or "")
    monkeypatch.setattr(cpu_dtype, "_cpu_flags", lambda: {"avx512_fp16"})
    assert cpu_dtype.slow_dtype_warning(torch.float16) is None
    assert cpu_dtype.slow_dtype_warning(torch.float32) is None

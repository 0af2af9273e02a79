"""Programmatic dependent launch (`gapless.pdl`, `GAPLESS_PDL`): off by default and wherever it cannot run;
where it runs, every kernel of a decode step waits for the one before it before it reads or writes
anything a kernel may touch (compiled for sm_90 here), and the tokens are the same (on a GPU)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from gapless import pdl

# the kernels of an FP8 model's decode step, each compiled with PDL for sm_90 below
DECODE_KERNELS = [
    "_act_and_mul_kernel",
    "_decode_split_kernel",
    "_fp8_gemm_kernel",
    "_fp8_gemv_kernel",
    "_fp8_quant_kernel",
    "_qk_norm_rope_store_kernel",
    "_rms_norm_kernel",
]


def test_off_by_default_and_on_the_cpu(monkeypatch):
    monkeypatch.delenv("GAPLESS_PDL", raising=False)
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("GAPLESS_PDL", "1")
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": False}  # (no GPU, or the interpreter)
    if torch.cuda.is_available():
        monkeypatch.setenv("GAPLESS_PDL", "0")
        assert pdl.launch_args(torch.device("cuda")) == {"PDL": False}


@pytest.mark.slow  # (sm_90 compiles in a child process, ~40 s)
def test_each_decode_kernel_waits_first_in_its_sm90_ptx_with_pdl():
    """With PDL forced on, each kernel of an FP8 decode step builds for sm_90 with Triton's `launch_pdl`,
    and its PTX waits (`griddepcontrol.wait`) before its first load of anything but a weight and lets
    the next kernel go (`griddepcontrol.launch_dependents`) after; the GEMMs prefetch weights first."""
    from gapless.testing.triton_compile import compile_child

    script = textwrap.dedent(
        """
        import json, re, torch
        from unittest import mock
        from gapless import pdl
        from gapless.attention import triton_kernels as tk
        from gapless.attention.base import AttentionMetadata
        from gapless.model.fused import triton_kernels as fk
        from gapless.model.quant.fp8 import quantize_rows
        from gapless.model.quant.fp8_kernel import fp8_gemm
        from gapless.testing.triton_compile import Compiler
        bf = torch.bfloat16
        i64 = lambda *v: torch.tensor(v, dtype=torch.int64)
        with mock.patch.object(pdl, "active", lambda device: True), Compiler(90) as c:
            x = torch.zeros(2, 256, dtype=bf)
            fk.rms_norm(x, x[0], 1e-6, "llama", x, round_group=128)
            fk.act_and_mul(torch.zeros(2, 512, dtype=bf), "silu")
            q, kv = torch.zeros(1, 8, 128, dtype=bf), torch.zeros(64, 2, 128, dtype=bf)
            w = torch.ones(128, dtype=bf)
            fk.qk_norm_rope_store(i64(0), q, kv[:1], kv[:1], torch.zeros(64, 256), kv, kv, i64(3),
                                  (w, w, 1e-6, "llama"))
            table = torch.arange(64, dtype=torch.int32)[None, :].clone()
            meta = AttentionMetadata(i64(0), i64(40), i64(1), i64(0), table, 1, 41, True)
            tk.decode_attention(q, kv, kv, meta, 4, 0.1)
            wq, ws = quantize_rows(torch.randn(256, 256))
            for rows in (1, 2):
                fp8_gemm(torch.zeros(rows, 256, dtype=bf), wq, ws, 1, 0, 128, None)
        out = {}
        for name, k in c.compiled:
            ptx = k.asm["ptx"]
            wait = ptx.find("griddepcontrol.wait")
            loads = [m.start() for m in re.finditer(r"ld\\.global", ptx)]
            prefetch = ptx.find("prefetch.global.L2")
            out[name] = [bool(k.metadata.launch_pdl), wait, "griddepcontrol.launch_dependents" in ptx,
                         sum(p < wait for p in loads), -1 < prefetch < wait]
        print(json.dumps([out, len(c.failed)]))
        """
    )
    out = compile_child(script, "compiling the decode kernels with PDL")
    if out is None:
        pytest.skip("this triton has no NVIDIA backend to compile with")
    kernels, failed = json.loads(out.strip().splitlines()[-1])
    assert failed == 0 and sorted(kernels) == DECODE_KERNELS, kernels
    for name, (launch_pdl, wait, lets_go, loads_before, prefetched) in kernels.items():
        assert launch_pdl and wait > 0 and lets_go, name
        # only the RMSNorm's weight is loaded before its wait (a weight: no kernel writes it), and the
        # GEMMs' weights fetched into L2
        assert loads_before == (1 if name == "_rms_norm_kernel" else 0), (name, loads_before)
        assert prefetched == (name in ("_fp8_gemm_kernel", "_fp8_gemv_kernel")), name


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="programmatic dependent launch needs an sm_90+ GPU",
)
def test_cuda_graph_tokens_are_the_same_with_pdl(ckpt_factory, monkeypatch):
    """A tiny Qwen3 in FP8 on CUDA graphs (every decode kernel Triton's): greedy tokens with PDL equal
    those without, for a batch of ragged prompts."""
    from gapless import LLM, SamplingParams
    from gapless.testing.hf_reference import make_prompts

    prompts = make_prompts(1000, n=4, max_len=40, shared_prefix=8)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("GAPLESS_PDL", on)
        with LLM(str(ckpt_factory("qwen3")), quantization="fp8", fused_kernels="triton") as llm:
            outs[on] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["1"] == outs["0"]

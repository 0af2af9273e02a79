"""`--cpu-compile`: decode batches through torch.compile'd decoder layers on the CPU give transformers'
greedy tokens (divergence only at near-ties), the compile happens at start-up, a compiler failure falls
back to the eager layers with the same tokens, and the combinations it does not take are refused."""

from __future__ import annotations

import logging

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.config import EngineConfig
from gapless.engine import cpu_compile
from gapless.testing.hf_reference import (
    TIE_TOLERANCE,
    check_greedy,
    hf_greedy,
    load_hf_model,
    make_prompts,
)

MAX_NEW = 8
PARAMS = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=1024, cpu_worker="inline", **kw)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_compiled_decode_equals_transformers(ckpt_factory, arch):
    """One request alone, then four at once (the two graphs warm-up made): every decode step runs the
    compiled layers and the tokens are transformers' (a near-tie at most, counted)."""
    path = ckpt_factory(arch)
    _compiled_equals(path, load_hf_model(path), seed=500)


def _compiled_equals(path, reference, seed: int, tol: float = TIE_TOLERANCE) -> None:
    """The compiled decode's greedy tokens (`_compiled_greedy`) of four prompts are `reference`'s, or
    diverge at a near-tie (within `tol`) once at most."""
    prompts = make_prompts(seed, n=4, shared_prefix=0, max_len=24)
    refs = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    outs = _compiled_greedy(path, prompts)
    ties = [check_greedy(o, r, tol=tol) for o, r in zip(outs, [refs[0], *refs])]
    assert sum(t is not None for t in ties) <= 1, ties


def _compiled_greedy(path, prompts) -> list[list[int]]:
    """Greedy tokens of `prompts[0]` alone, then of all `prompts` at once, with the decode compiled;
    checks that every decode step ran the compiled layers and that nothing compiled after the warm-up
    (a request may not wait for a compile)."""
    from torch._dynamo.utils import counters

    with _llm(path, cpu_compile=True) as llm:
        compiled = llm.engine.runner.model.model.compiled_layers
        assert compiled is not None and compiled.failed is None, "the warm-up did not compile"
        runs, graphs = compiled.runs, counters["stats"]["unique_graphs"]
        outs = llm.generate(prompts[:1], PARAMS, use_tqdm=False) + llm.generate(
            prompts, PARAMS, use_tqdm=False
        )
        llm.check_integrity()
        # every decode step of both calls (MAX_NEW - 1 per call: the first token comes from the prefill)
        assert compiled.runs - runs == 2 * (MAX_NEW - 1)
        assert counters["stats"]["unique_graphs"] == graphs, "a decode compiled again after the warm-up"
    return [o.token_ids for o in outs]


@pytest.mark.slow
def test_bitsandbytes_4bit_layers_compile_once_and_give_bitsandbytes_tokens(ckpt_factory, tmp_path):
    """NF4 layers kept on bitsandbytes' CPU kernel (its codes laid out for it at load): the compiled decode
    gives the tokens of transformers running the checkpoint through bitsandbytes, compiling nothing after
    its warm-up."""
    from gapless.model.quant import bnb
    from gapless.testing.bnb_checkpoints import write_bnb

    if not bnb.kept(torch.device("cpu")):
        pytest.skip(
            "no bitsandbytes, or no AVX512-BF16 for its fused 4-bit CPU kernel: 4-bit layers stay float"
        )
    qdir, _ = write_bnb(ckpt_factory("llama"), tmp_path, "nf4")
    _compiled_equals(qdir, load_hf_model(qdir), seed=503)


@pytest.mark.slow
def test_a_quantized_gguf_compiles_once_and_equals_transformers(ckpt_factory, tmp_path):
    """GGUF layers kept quantized (int4 gate/up, int8 rows with int8 activations through fbgemm's packed
    weight): the compiled decode reads the same file as transformers does (near-ties counted) and
    compiles nothing after its warm-up."""
    from transformers import AutoModelForCausalLM

    from gapless.testing.gguf_files import write_gguf

    path = write_gguf(ckpt_factory("llama", rope_scaling=None), tmp_path / "llama.Q4_1.gguf", "Q4_1")
    ref = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    # the int8 rows' rounding moves logits by up to ~0.15 (tests/model/test_quant_gguf.py)
    _compiled_equals(path, ref, seed=502, tol=0.3)


@pytest.mark.slow
def test_an_int8_checkpoint_in_groups_compiles_once_and_equals_transformers(ckpt_factory, tmp_path):
    """Weight-only int8 in groups, asymmetric, on torch's CPU kernels (the int4 kernel over each value's
    two nibbles, the zeros' lost bits added as x's group sums): the compiled decode gives transformers'
    tokens on the dequantized weights (near-ties of the bfloat16 roundings counted) and compiles nothing
    after its warm-up."""
    from gapless.model.quant.int4_kernels import CPU_KERNEL
    from gapless.testing.quant_checkpoints import write_quantized

    qdir, refdir = write_quantized(ckpt_factory("llama"), tmp_path, "gptq", bits=8, group=32, sym=False)
    prompts = make_prompts(503, n=4, shared_prefix=0, max_len=24)
    hf = load_hf_model(refdir)
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    with _llm(qdir) as llm:
        assert any(CPU_KERNEL in f for f, _ in llm.engine.info.weight_formats)
    outs = _compiled_greedy(qdir, prompts)
    ties = [check_greedy(o, r, tol=0.15) for o, r in zip(outs, [refs[0], *refs])]
    assert sum(t is not None for t in ties) <= 1, ties


def test_a_compiler_error_falls_back_to_the_eager_layers(ckpt_factory, monkeypatch, caplog):
    """A compile that raises (no C++ compiler, an op inductor cannot lower) is logged once and the engine
    decodes eagerly: the same tokens as an engine without the option."""
    path = ckpt_factory("llama")
    prompts = make_prompts(501, n=2, shared_prefix=0, max_len=16)

    def broken(fn, **kw):
        def raises(*args):
            raise RuntimeError("InductorError: no working C++ compiler found\nmore detail")

        return raises

    monkeypatch.setattr(torch, "compile", broken)
    with _llm(path) as llm:
        want = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    with caplog.at_level(logging.WARNING, logger=cpu_compile.__name__), _llm(path, cpu_compile=True) as llm:
        compiled = llm.engine.runner.model.model.compiled_layers
        assert compiled is not None and compiled.failed is not None and "C++ compiler" in compiled.failed
        got = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        assert compiled.runs == 0
    assert got == want
    assert sum("decoding eagerly" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("other", [dict(enable_lora=True), dict(tensor_parallel_size=2)])
def test_what_it_does_not_take_is_refused(other):
    with pytest.raises(ValueError, match="cpu_compile"):
        EngineConfig(model="m", cpu_compile=True, **other)


def test_opaque_gemm_op_runs_its_owner_and_holds_it_weakly():
    """The custom op a compiled graph calls runs its owner's own GEMM, its fake gives the output's shape
    without the owner's weight, and a handle does not keep its owner (a closed engine's weights) alive."""
    import gc
    import weakref

    from torch._subclasses.fake_tensor import FakeTensorMode

    from gapless.model import opaque_gemm

    class Owner:
        out_features = 3

        def __init__(self) -> None:
            self.weight = torch.arange(12.0).view(3, 4)
            self.handle = opaque_gemm.register(self)

        def gemm(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.t()

    owner, x = Owner(), torch.ones(2, 4)
    assert torch.equal(opaque_gemm._OP(x, owner.handle, 3), owner.gemm(x))
    assert torch.equal(opaque_gemm.call(owner, x), owner.gemm(x))  # (eagerly: the owner's own call)
    with FakeTensorMode() as mode:
        fake = opaque_gemm._OP(mode.from_tensor(x), mode.from_tensor(owner.handle), 3)
    assert fake.shape == (2, 3)
    gone, handle = weakref.ref(owner), int(owner.handle)
    del owner
    gc.collect()
    assert gone() is None and handle not in opaque_gemm._LIVE

"""A quantized LM head at every bit width the int4/int8 path reads (`int4.install_head`): 2, 3, 4 and 8
bits, in GPTQ's, AutoRound's and compressed-tensors' layouts. 2- and 3-bit words pack a head's rows (GPTQ's
zeros run along the outputs) 16 or 32 at a time, so the tiny models here have a vocab of 1024, not the
tokenizer's 1000, which `write_quantized` refuses to pack by name. Each load holds the head's weight as
the reference's bit for bit, and gives transformers' prompt logprobs and greedy tokens on the same weights
dequantized; two ranks hold its rows across a 3-bit word. (The 4-bit head of each writer:
test_quant_int4.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gapless import LLM, SamplingParams
from gapless.model import loader
from gapless.model.quant import weights_held
from gapless.model.quant.int4 import Int4LinearMethod
from gapless.testing.hf_reference import check_greedy, hf_greedy, hf_logits, load_hf_model, make_prompts
from gapless.testing.quant_checkpoints import layout_label, write_quantized
from gapless.testing.ranks import load_as_ranks

CPU = torch.device("cpu")
MAX_NEW = 8
VOCAB = 1024  # (a multiple of 32: whole 3-bit words of the head's rows)

# the reference path, exact against the dequantized weights (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("int4_reference_path")


def _head(model: torch.nn.Module) -> Int4LinearMethod:
    """The model's LM head on the int4/int8 path, its float weight not held."""
    method = model.lm_head.linear_method
    assert isinstance(method, Int4LinearMethod) and model.lm_head.weight.numel() == 0
    return method


def _run(path: Path, prompts: list[list[int]]) -> list:
    """gapless' greedy continuations of `prompts`, with each prompt token's logprob."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=2048, overlap=False) as llm:
        return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize(
    "arch,layout,bits,sym",
    [
        ("llama", "gptq", 2, False),
        ("llama", "gptq", 3, False),
        ("llama", "gptq", 4, True),
        ("llama", "gptq", 8, False),
        ("qwen2", "gptq_v2", 3, True),  # a tied model: the table stays float, the head quantized beside it
        ("llama", "auto_round:auto_gptq", 3, False),  # AutoRound's `extra_config` head
        ("qwen3", "compressed-tensors", 8, False),  # (its pack-quantized: 4 and 8 bits)
    ],
)
def test_a_quantized_head_gives_the_dequantized_models_logits(
    ckpt_factory, tmp_path, arch, layout, bits, sym
):
    """The head held on the path in the checkpoint's bits (its weight the reference's bit for bit, the
    embedding table float and untouched), and every prompt token's logprob within 1e-3 of transformers' on
    the reference's weights, its greedy tokens equal (at most one near-tie)."""
    qdir, refdir = write_quantized(
        ckpt_factory(arch, vocab_size=VOCAB), tmp_path, layout, bits=bits, group=32, sym=sym, head=True
    )
    model = loader.load_model(qdir, torch.float32, CPU)
    reference = load_file(str(refdir / "model.safetensors"))
    assert torch.equal(_head(model).dequantized(torch.float32), reference["lm_head.weight"])
    assert reference["lm_head.weight"].shape == (VOCAB, model.cfg.hidden_size)
    assert torch.equal(model.model.embed_tokens.weight, reference["model.embed_tokens.weight"])
    assert weights_held(model)[0] == {layout_label(layout, bits, 32, sym): 9}  # (8 projections and the head)
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    outs = _run(qdir, prompts)
    ref = load_hf_model(refdir)
    for prompt, out in zip(prompts, outs):
        ours = torch.tensor([next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]])
        logits = hf_logits(ref, prompt)
        assert logits.shape[-1] == VOCAB
        theirs = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3)
    notes = [check_greedy(o.token_ids, hf_greedy(ref, p, MAX_NEW)) for o, p in zip(outs, prompts)]
    assert sum(n is not None for n in notes) <= 1, notes


def test_two_ranks_hold_a_3_bit_heads_rows_across_a_word(ckpt_factory, tmp_path):
    """A 3-bit head of 1056 rows (33 words of GPTQ's zeros, 3 x 32 bits each) over two ranks: each holds
    528, its half cut inside a word, and the halves are the whole head's weight."""
    qdir, refdir = write_quantized(
        ckpt_factory("llama", vocab_size=1056), tmp_path, "gptq", bits=3, group=32, head=True
    )
    whole, ranks = load_as_ranks(qdir)
    want = load_file(str(refdir / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(_head(whole).dequantized(torch.float32), want)
    halves = [_head(r).dequantized(torch.float32) for r in ranks]
    assert [len(h) for h in halves] == [528, 528]
    assert torch.equal(torch.cat(halves), want)


@pytest.mark.parametrize("bits,per,vocab", [(3, 32, 1024), (2, 16, 1008)])
def test_a_head_the_layout_cannot_pack_is_refused_by_name(ckpt_factory, tmp_path, bits, per, vocab):
    """The tokenizer's vocab of 1000 as a 2- or 3-bit GPTQ head (GPTQ's zeros packed along its rows, `per`
    a word or, 3 bits, 32 in 3 words): refused by `write_quantized`, naming the head, its shape and a vocab it
    can pack (was: a RuntimeError deep in the packing)."""
    with pytest.raises(ValueError, match=r"^lm_head\.weight \[1000, 64\]: gptq packs ") as e:
        write_quantized(ckpt_factory("llama"), tmp_path, "gptq", bits=bits, group=32, head=True)
    assert (
        f"along its outputs, and 1000 is not a multiple of {per} (an LM head's vocab: e.g. {vocab})"
        in str(e.value)
    )

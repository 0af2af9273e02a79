"""GGUF files written wrong (by hand, or by a broken converter: `write_gguf`'s `edits`, `retype`) are refused
before any weight loads, in one line naming the tensor, its shape and the shape the config from the file's
metadata gives it (`gapless.model.quant.gguf_shapes`): a mixture's experts not stacked, their dimensions
swapped, a hidden size, width or expert count unlike the metadata's, an expert tensor missing, and a
tensor's type in the header unlike the bytes written for it. Most of these once failed in the load with a
raw exception (an AttributeError, a concatenation's RuntimeError), loaded other weights than the file's, or
were refused in words that named no tensor of the file.
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from gapless.model import gguf, loader
from gapless.model.config import load_model_config
from gapless.testing.gguf_files import retype, write_gguf

CPU = torch.device("cpu")
_MOE = dict(mlp_only_layers=None)  # (every layer routed, as llama.cpp writes a qwen3moe file)


def _ckpt(ckpt_factory, arch: str):
    """The tiny checkpoint of `arch` as llama.cpp writes it: a Qwen3-MoE without dense layers, Qwen2-MoE's
    shared expert whole blocks of 32."""
    return ckpt_factory(
        arch, **{"qwen3_moe": _MOE, "qwen2_moe": dict(shared_expert_intermediate_size=64)}.get(arch, {})
    )


def _refusal(path) -> str:
    """The one-line ValueError a CPU load of `path` is refused with."""
    with pytest.raises(ValueError) as e:
        loader.load_model(path, torch.float32, CPU)
    assert "\n" not in str(e.value)
    return str(e.value)


def _drop_last_expert(w: np.ndarray) -> np.ndarray:
    return w[:-1]


def _swap(w: np.ndarray) -> np.ndarray:
    return w.swapaxes(-1, -2)


def _shape(tensor: str, found: str, want: str) -> str:
    """The refusal of `tensor` (layer 0's), of shape `found`, where the config takes `want` (and why)."""
    return (
        re.escape(f"GGUF tensor blk.0.{tensor}.weight is {found} (row-major), but ")
        + ".* takes "
        + re.escape(want)
    )


@pytest.mark.parametrize(
    ("arch", "qtype", "tensor", "edit", "found", "want"),
    [
        # one expert's matrix where the stacked experts belong (was: AttributeError, `gate_up_proj` is not an
        # nn.Module, on both quantized paths)
        (
            "qwen3_moe",
            "Q8_0",
            "ffn_gate_exps",
            lambda w: w[0],
            [32, 64],
            "[8, 32, 64] (experts 8, expert width 32",
        ),
        ("mixtral", "Q8_0", "ffn_up_exps", lambda w: w[0], [32, 64], "[8, 32, 64]"),
        # rows and columns swapped; a hidden size unlike the metadata's (was: RuntimeError in `torch.cat`)
        ("qwen3_moe", "Q8_0", "ffn_gate_exps", _swap, [8, 64, 32], "[8, 32, 64]"),
        (
            "mixtral",
            "Q8_0",
            "ffn_down_exps",
            _swap,
            [8, 32, 64],
            "[8, 64, 32] (experts 8, hidden 64, expert width 32)",
        ),
        ("qwen3_moe", "Q8_0", "ffn_up_exps", lambda w: w[..., :32], [8, 32, 32], "[8, 32, 64]"),
        # an expert missing from one of the stacks (was: "lacks weights: ...gate_up_proj#(7, 'gate')")
        ("qwen3_moe", "F32", "ffn_down_exps", _drop_last_expert, [7, 64, 32], "[8, 64, 32]"),
        ("qwen2_moe", "Q8_0", "ffn_gate_exps", _drop_last_expert, [7, 32, 64], "[8, 32, 64]"),
        # a dense model's projection transposed (was: loaded, on the CPU's GGUF layers, in the wrong shape)
        ("qwen3", "Q8_0", "attn_output", _swap, [128, 64], "[64, 128] (hidden 64, q 128)"),
    ],
    ids=[
        "qwen3moe-one-expert",
        "mixtral-one-expert",
        "qwen3moe-swapped",
        "mixtral-swapped-down",
        "qwen3moe-narrow-hidden",
        "qwen3moe-7-experts",
        "qwen2moe-7-experts",
        "qwen3-o-swapped",
    ],
)
def test_a_tensor_unlike_the_metadatas_model_is_refused_by_name(
    ckpt_factory, tmp_path, arch, qtype, tensor, edit, found, want
):
    """Layer 0's `tensor` changed by `edit` as a broken converter would write it: refused in one line
    naming it, its shape and the config's."""
    path = write_gguf(
        _ckpt(ckpt_factory, arch), tmp_path / "m.gguf", qtype, edits={f"blk.0.{tensor}.weight": edit}
    )
    message = _refusal(path)
    assert re.search(_shape(tensor, str(found), want), message), message


def test_a_routed_layer_without_its_experts_is_refused_by_name(ckpt_factory, tmp_path):
    """A layer's up projections left out of the file: refused naming the tensor (was: "lacks weights:
    ...gate_up_proj#(0, 'up'), ...")."""
    edits = {"blk.0.ffn_up_exps.weight": lambda w: None}
    path = write_gguf(_ckpt(ckpt_factory, "qwen3_moe"), tmp_path / "m.gguf", "Q8_0", edits=edits)
    assert "layer 0 has a router (ffn_gate_inp), but the file has no blk.0.ffn_up_exps.weight" in _refusal(
        path
    )


@pytest.mark.parametrize("field", ["num_experts", "num_local_experts"])
def test_an_expert_count_unlike_the_tensors_is_refused_by_name(ckpt_factory, tmp_path, field):
    """A file whose metadata says 4 experts where its tensors stack 8: refused naming the router and both
    counts (was: "weight shape (8, 64) does not fit parameter (4, 64)", naming no tensor)."""
    arch = "qwen3_moe" if field == "num_experts" else "mixtral"
    ckpt = shutil.copytree(_ckpt(ckpt_factory, arch), tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {field: 4}))
    path = write_gguf(ckpt, tmp_path / "m.gguf", "Q8_0")
    assert gguf.metadata(path)[f"{gguf.metadata(path)['general.architecture']}.expert_count"] == 4
    message = _refusal(path)
    assert "GGUF tensor blk.0.ffn_gate_inp.weight is [8, 64]" in message
    assert "takes [4, 64] (experts 4, hidden 64)" in message


@pytest.mark.parametrize(
    ("tensor", "qtype", "says"),
    [
        # a type of the same block but fewer bytes: its successor's bytes no longer where it would start
        # (was: loaded, the Q8_0 bytes read as Q4_0's weights)
        ("blk.0.attn_q.weight", "Q4_0", r"blk\.0\.attn_v\.weight starts at byte .* blk\.0\.attn_q\.weight"),
        (
            "blk.0.ffn_up_exps.weight",
            "Q4_0",
            r"where blk\.0\.ffn_up_exps\.weight \(Q4_0 \[8, 32, 64\]\) ends",
        ),
        # a type whose blocks do not divide the rows: gguf's reader refuses it (as it did before)
        ("blk.0.attn_q.weight", "Q4_K", r"not a multiple of Q4_K block size"),
    ],
    ids=["q4_0-in-the-middle", "q4_0-experts", "q4_k-rows-not-blocks"],
)
def test_a_type_in_the_header_unlike_the_bytes_written_is_refused(
    ckpt_factory, tmp_path, tensor, qtype, says
):
    """A Q8_0 file whose header gives a tensor another type (its bytes and shape kept): refused in one
    line, as llama.cpp refuses such a file, not read as other weights."""
    from gguf import GGUFReader

    path = write_gguf(_ckpt(ckpt_factory, "qwen3_moe"), tmp_path / "m.gguf", "Q8_0")
    written = {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}  # (not gapless's reader,
    assert written[tensor] == "Q8_0"  # which would keep the header before retype)
    retype(path, tensor, qtype)
    message = _refusal(path)
    assert re.search(says, message), message


def test_bytes_after_the_last_tensor_are_let_be(ckpt_factory, tmp_path):
    """As llama.cpp lets them: a file with bytes appended after its tensors loads (so a header that gives
    the last tensor a type of fewer bytes is not seen; the others' are)."""
    path = write_gguf(_ckpt(ckpt_factory, "qwen3"), tmp_path / "m.gguf", "Q8_0")
    with open(path, "ab") as f:
        f.write(bytes(8192))
    assert loader.load_model(path, torch.float32, CPU) is not None


def test_the_server_refuses_such_a_file_in_one_line(ckpt_factory, tmp_path, capsys):
    """`gapless serve` on a file whose experts are not stacked: exit status 2 and one line naming the
    tensor, before any worker starts (was: status 1, the scheduler worker's AttributeError traceback)."""
    from gapless.__main__ import main

    edits = {"blk.0.ffn_gate_exps.weight": lambda w: w[0]}
    path = write_gguf(_ckpt(ckpt_factory, "qwen3_moe"), tmp_path / "m.gguf", "Q8_0", edits=edits)
    with pytest.raises(ValueError):  # (the config's read refuses it: else a worker would start, and fail)
        load_model_config(path)
    assert main(["serve", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "GGUF tensor blk.0.ffn_gate_exps.weight is [32, 64] (row-major)" in err


@pytest.mark.parametrize("key", ["qwen3moe.embedding_length", "qwen3moe.expert_used_count"])
def test_a_metadata_key_the_config_needs_is_refused_by_name_where_missing(
    ckpt_factory, tmp_path, monkeypatch, key
):
    """A file without a key its config cannot do without: refused naming it (was: a raw KeyError)."""
    path = write_gguf(_ckpt(ckpt_factory, "qwen3_moe"), tmp_path / "m.gguf", "Q8_0")
    meta = {k: v for k, v in gguf.metadata(path).items() if k != key}
    monkeypatch.setattr(gguf, "metadata", lambda p: meta)
    with pytest.raises(
        ValueError, match=f"its GGUF metadata has no {re.escape(key)}, which its model's config"
    ):
        load_model_config(path)


def test_a_file_that_says_no_vocabulary_is_refused_by_name(ckpt_factory, tmp_path, monkeypatch):
    """No vocab_size, token list nor embedding table: refused naming the three (was: a StopIteration)."""
    drop = {"token_embd.weight": lambda w: None}
    path = write_gguf(_ckpt(ckpt_factory, "qwen3"), tmp_path / "m.gguf", "Q8_0", edits=drop)
    meta = {
        k: v for k, v in gguf.metadata(path).items() if k not in ("qwen3.vocab_size", "tokenizer.ggml.tokens")
    }
    monkeypatch.setattr(gguf, "metadata", lambda p: meta)
    with pytest.raises(ValueError, match="no qwen3.vocab_size, tokenizer.ggml.tokens nor token_embd.weight"):
        load_model_config(path)

"""Weight files that are not whole are refused in one line before any worker starts: a shard the index
names but the folder lacks, a file cut short or with bytes past its tensors, a Git LFS pointer in the
weights' place, a GGUF file cut short. The header check agrees with safetensors' own reader on which
files it can read, and passes what transformers writes (one file, and shards with an index)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors import SafetensorError, safe_open

from gapless.__main__ import main
from gapless.model.weight_files import WeightFileError, check_safetensors, check_whole

LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 653488\n"


def _refused(capsys, model: Path) -> str:
    assert main(["serve", str(model), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def ckpt(ckpt_factory, tmp_path) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(ckpt_factory("qwen3"), path)
    return path


def test_a_checkpoint_cut_short_or_padded_is_refused_in_one_line(ckpt, capsys):
    weights = ckpt / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-64])
    err = _refused(capsys, ckpt)
    assert (
        f"model.safetensors is cut short: {len(whole) - 64:,} bytes where its tensors need {len(whole):,}"
        in err
    )
    weights.write_bytes(whole + b"\0" * 10)
    assert "10 bytes past its last tensor" in _refused(capsys, ckpt)
    weights.write_bytes(b"\x00" * 100)
    assert "model.safetensors: not a safetensors file (100 bytes, no header in them)" in _refused(
        capsys, ckpt
    )
    weights.write_bytes(whole[:8] + b"{not json" + whole[17:])
    assert "its header does not parse" in _refused(capsys, ckpt)
    weights.write_bytes(LFS)
    err = _refused(capsys, ckpt)
    assert "model.safetensors is a Git LFS pointer, not the weights" in err and "git lfs pull" in err


def test_a_shard_its_index_names_but_the_folder_lacks_is_refused(ckpt, capsys):
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00003.safetensors")
    shards = {"a": "model-00001-of-00003.safetensors", "b": "model-00002-of-00003.safetensors"}
    shards["c"] = "model-00003-of-00003.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    err = _refused(capsys, ckpt)
    assert "2 of the 3 weight files model.safetensors.index.json names are missing" in err
    assert "(model-00002-of-00003.safetensors and 1 more): a download that stopped?" in err
    (ckpt / "model.safetensors.index.json").write_text("{}")
    assert "model.safetensors.index.json: not a safetensors index ('weight_map')" in _refused(capsys, ckpt)


def test_a_gguf_cut_short_or_an_lfs_pointer_in_its_place_is_refused(ckpt, tmp_path, capsys):
    from gapless.testing.gguf_files import write_random_gguf

    path = write_random_gguf(ckpt, tmp_path / "m.gguf", qtype="Q8_0")
    whole = path.read_bytes()
    path.write_bytes(whole[:-1000])
    assert f"m.gguf: not a whole GGUF file ({len(whole) - 1000:,} bytes; gguf's reader: " in _refused(
        capsys, path
    )
    path.write_bytes(LFS)
    assert "m.gguf is a file but a Git LFS pointer, not the weights" in _refused(capsys, path)


def test_the_header_check_agrees_with_safetensors_on_what_it_reads(ckpt):
    """Cut short by any amount, padded, or whole: the check refuses a file exactly when safetensors' own
    reader cannot open it."""
    weights = ckpt / "model.safetensors"
    whole = weights.read_bytes()
    variants = [whole, whole + b"\0", whole + b" " * 7, whole[:9], whole[:4], b""]
    variants += [whole[:-k] for k in (1, 2, 63, 64, 1000, len(whole) // 2)]
    outcomes: list[bool] = []
    for data in variants:
        weights.write_bytes(data)
        try:
            with safe_open(str(weights), framework="pt") as f:
                f.keys()
            readable = True
        except (SafetensorError, OSError):
            readable = False
        try:
            check_safetensors(weights)
            whole_here = True
        except WeightFileError:
            whole_here = False
        assert whole_here == readable, (len(data), len(whole))
        outcomes.append(readable)
    assert outcomes.count(True) == 1  # the whole file alone


def test_what_transformers_writes_is_whole(tmp_path):
    """One file, and shards with an index, as `save_pretrained` writes them (the test checkpoints' writer)."""
    from gapless.testing.checkpoints import make_checkpoint

    one = make_checkpoint(tmp_path / "one", "llama")
    shards = make_checkpoint(tmp_path / "shards", "llama", shards=3)
    assert len(list(shards.glob("*.safetensors"))) > 2 and (shards / "model.safetensors.index.json").is_file()
    check_whole(one)
    check_whole(shards)

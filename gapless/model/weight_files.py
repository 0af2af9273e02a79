"""A checkpoint's safetensors files, and whether they are whole, from their headers alone (no torch).

`safetensors_files` lists what a load reads: the shards the index names, or every `*.safetensors` file.
`check_whole` refuses, in one line and before any weight loads, what would otherwise stop a load midway
with a reader's traceback: a shard the index names but the folder lacks (a download that stopped), a file
cut short (a copy that stopped), a Git LFS pointer in place of the weights (a repository cloned without
git-lfs), or a file that is no safetensors file at all.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

SAFETENSORS_INDEX = "model.safetensors.index.json"
# what a Git LFS pointer file starts with: the weights' stand-in in a clone made without git-lfs
LFS_POINTER = b"version https://git-lfs"
LFS_HINT = "a Git LFS pointer, not the weights (cloned without git-lfs: run `git lfs pull` in it)"
_HEADER_LIMIT = 100_000_000  # safetensors' own bound on a header's length


class WeightFileError(ValueError):
    """A weight file is missing, cut short or not a weight file; the message is one line naming it."""


def index_shards(checkpoint: Path) -> list[str] | None:
    """The safetensors files a checkpoint directory's index names, sorted; None where it has no index."""
    index = checkpoint / SAFETENSORS_INDEX
    if not index.is_file():
        return None
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def safetensors_files(path: Path) -> list[Path]:
    """The weight files a load of checkpoint directory `path` reads: the index's shards where it has an
    index, else every `*.safetensors` file but Mistral's own `consolidated*` copy of the same weights
    (unless it is the only one); FileNotFoundError where there is none."""
    shards = index_shards(path)
    if shards is not None:
        return [path / n for n in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return [f for f in files if not f.name.startswith("consolidated")] or files


def is_lfs_pointer(file: Path) -> bool:
    """Whether `file` is a Git LFS pointer (a small text file) rather than the content it stands for."""
    with file.open("rb") as f:
        return f.read(len(LFS_POINTER)) == LFS_POINTER


def check_whole(path: Path) -> None:
    """WeightFileError unless every file a load of checkpoint directory `path` reads is there and whole."""
    try:
        files = safetensors_files(path)
    except FileNotFoundError as e:
        raise WeightFileError(str(e)) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightFileError(f"{path / SAFETENSORS_INDEX}: not a safetensors index ({e})") from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise WeightFileError(
            f"{path}: {len(missing)} of the {len(files)} weight files {SAFETENSORS_INDEX} names are missing "
            f"({missing[0]}{more}): a download that stopped?"
        )
    for file in files:
        check_safetensors(file)


def check_safetensors(file: Path) -> None:
    """WeightFileError unless `file` is a whole safetensors file: an 8-byte length, a JSON header of that
    length, and exactly the bytes its tensors' offsets cover after it."""
    if is_lfs_pointer(file):
        raise WeightFileError(f"{file} is {LFS_HINT}")
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if not 0 < length <= min(_HEADER_LIMIT, size - 8):
            raise WeightFileError(f"{file}: not a safetensors file ({size:,} bytes, no header in them)")
        try:
            header = json.loads(f.read(length))
            ends = (int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__")
            end = max(ends, default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise WeightFileError(f"{file}: not a safetensors file (its header does not parse)") from None
    need = 8 + length + end
    if size < need:
        raise WeightFileError(
            f"{file} is cut short: {size:,} bytes where its tensors need {need:,} (copy or download it again)"
        )
    if size > need:
        raise WeightFileError(f"{file}: {size - need:,} bytes past its last tensor (not a safetensors file)")

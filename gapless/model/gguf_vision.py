"""A GGUF model's image encoder: llama.cpp's vision projector file (`mmproj`, `general.architecture: clip`),
as its `llama-server --mmproj` takes it and GGUF repositories ship it beside the model's files.

A model GGUF file is paired with the one projector file in its directory made for it (`mmproj_for`), or
with the file `--mmproj` names (`gapless.model.source.localize` links the two into one directory). The
pair runs as the Hugging Face vision-language model the two files were converted from: the model file's
config inside the projector's (`config_dict`), the projector's tensors under their checkpoint names
(`iter_weights`, by the `gguf` package's own name map, dequantized to float32), its image processor from
the projector's metadata (`new_processor`). Projector type `gemma3` (Gemma 3: a SigLIP tower,
average-pooled, RMS-normed and projected by one matrix) is read; another is refused by name.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gapless.model import gguf

log = logging.getLogger(__name__)

PROJECTORS = {"gemma3": "gemma3"}  # llama.cpp's `clip.projector_type`s read -> the model architecture of each
_TOWER = "vision_tower.vision_model."  # the checkpoint's names of the tower (transformers v4's layout)
_TOWER_PARTS = ("embeddings.patch_embedding", "embeddings.position_embedding", "post_layernorm")
_LAYER_PARTS = (
    "layer_norm1",
    "layer_norm2",
    "mlp.fc1",
    "mlp.fc2",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.out_proj",
)
# Gemma 3's projector, as its converter names it (`mm_input_projection_weight` read as `.weight`) -> the
# checkpoint's names
_PROJECTOR = {
    "multi_modal_projector.mm_input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
    "multi_modal_projector.mm_soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight",
}
_NORM_PLUS_ONE = "mm.soft_emb_norm.weight"  # stored plus 1 (Gemma's RMSNorm multiplies by 1 + w)
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")  # Gemma 3's, in its vocabulary
_POOL = 4  # the projector's pooling of the patch grid where the file does not say (Gemma 3's)


def is_mmproj(path: str | Path) -> bool:
    """A GGUF file of llama.cpp's `clip` architecture: a projector, not a model."""
    return gguf.is_gguf_file(path) and gguf.field(path, "general.architecture") == "clip"


def mmproj_for(path: str | Path) -> Path | None:
    """The projector paired with the model GGUF file `path`: the one `clip` file in its directory made for
    such a model (`_fits`: another model's projector in a shared folder is not), else None; two or more
    are refused by name (`--mmproj` names one)."""
    path = Path(path)
    if not path.is_file():
        return None
    found = [
        p for p in _projectors(str(path.parent.resolve()), path.parent.stat().st_mtime_ns) if _fits(path, p)
    ]
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise ValueError(
            f"{path.parent} holds {len(found)} vision projector files ({names}): name one with --mmproj"
        )
    return found[0] if found else None


@functools.lru_cache(maxsize=16)
def _projectors(folder: str, mtime_ns: int) -> list[Path]:
    """The projector files among `folder`'s GGUF files; one that cannot be read (another file's download
    cut short, say) is passed over with a warning, not let block the model beside it."""
    found = []
    for p in sorted(Path(folder).glob("*.gguf")):
        try:
            if is_mmproj(p):
                found.append(p)
        except ValueError as e:
            log.warning("%s (passed over in the search for a vision projector)", e)
    return found


def _kind(meta: dict[str, Any]) -> Any:
    return meta.get("clip.projector_type") or meta.get("clip.vision.projector_type")


def _fits(path: Path, mmproj: Path) -> bool:
    """Whether `mmproj` projects into the model file `path`'s embeddings: as wide, and of the model's
    architecture where its type is one read here (a type not read fits by width, to be refused by name)."""
    meta, arch = gguf.metadata(mmproj), gguf.field(path, "general.architecture")
    wide = meta.get("clip.vision.projection_dim") == gguf.field(path, f"{arch}.embedding_length")
    return wide and PROJECTORS.get(_kind(meta), arch) == arch


def _meta(mmproj: Path) -> dict[str, Any]:
    """The projector's metadata, refused by name unless it is a vision projector of a type read here."""
    meta = gguf.metadata(mmproj)
    kind = _kind(meta)
    if not meta.get("clip.has_vision_encoder") or kind not in PROJECTORS:
        raise ValueError(
            f"{mmproj.name}: vision projector type {kind!r} is not supported "
            f"(supported: {', '.join(PROJECTORS)}; --mmproj none runs the model as text alone)"
        )
    return meta


def _vision(meta: dict[str, Any]) -> dict[str, Any]:
    """The tower's `vision_config` (SigLIP's fields) from the projector's metadata."""
    return {
        "model_type": "siglip_vision_model",
        "hidden_size": int(meta["clip.vision.embedding_length"]),
        "intermediate_size": int(meta["clip.vision.feed_forward_length"]),
        "num_hidden_layers": int(meta["clip.vision.block_count"]),
        "num_attention_heads": int(meta["clip.vision.attention.head_count"]),
        "image_size": int(meta["clip.vision.image_size"]),
        "patch_size": int(meta["clip.vision.patch_size"]),
        "layer_norm_eps": float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        "vision_use_head": False,
    }


def config_dict(path: str | Path, mmproj: Path) -> dict[str, Any]:
    """The config of the model file `path` with its projector `mmproj`: Gemma 3's vision-language config,
    the model's own config as its `text_config`, the image tokens found in its vocabulary."""
    text = gguf.config_dict(path)
    meta = _meta(mmproj)
    if text["architectures"] != ["Gemma3ForCausalLM"]:
        raise ValueError(
            f"{mmproj.name} is Gemma 3's projector; {Path(path).name} is {text['architectures'][0]}"
        )
    if int(meta["clip.vision.projection_dim"]) != text["hidden_size"]:
        raise ValueError(
            f"{mmproj.name} projects to {meta['clip.vision.projection_dim']} wide; "
            f"{Path(path).name}'s embeddings are {text['hidden_size']} wide: not its projector"
        )
    vocab = list(gguf.field(path, "tokenizer.ggml.tokens") or [])
    missing = [t for t in IMAGE_TOKENS if t not in vocab]
    if missing:
        raise ValueError(
            f"{Path(path).name}'s vocabulary has no {', '.join(missing)}: not Gemma 3's vision model"
        )
    boi, eoi, image = (vocab.index(t) for t in IMAGE_TOKENS)
    vision = _vision(meta)
    pool = int(meta.get("clip.vision.projector.scale_factor", _POOL))
    side = vision["image_size"] // vision["patch_size"] // pool
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {**text, "model_type": "gemma3_text"},
        "vision_config": vision,
        "mm_tokens_per_image": side * side,
        "boi_token_index": boi,
        "eoi_token_index": eoi,
        "image_token_index": image,
        "eos_token_id": text["eos_token_id"],
        "tie_word_embeddings": text["tie_word_embeddings"],
    }


def _names(layers: int) -> dict[str, str]:
    """The projector file's tensor names -> the checkpoint's, through the `gguf` package's name map (the
    one llama.cpp's converter writes by)."""
    import gguf as gguf_py

    table = gguf_py.get_tensor_name_map(gguf_py.MODEL_ARCH.MMPROJ, layers)
    parts = [_TOWER + p for p in _TOWER_PARTS]
    parts += [f"{_TOWER}encoder.layers.{i}.{p}" for i in range(layers) for p in _LAYER_PARTS]
    written = {hf + s: hf + s for hf in parts for s in (".weight", ".bias")} | _PROJECTOR
    names = {table.get_name(w, try_suffixes=(".weight", ".bias")): hf for w, hf in written.items()}
    return {name: hf for name, hf in names.items() if name is not None}


def iter_weights(mmproj: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, float32 tensor) for each of the projector's tensors; one without a name is
    refused by name."""
    names = _names(int(_meta(mmproj)["clip.vision.block_count"]))
    for tensor in gguf.tensors(mmproj):
        name = names.get(tensor.name)
        if name is None:
            raise ValueError(f"{mmproj.name}: tensor {tensor.name!r} is not Gemma 3's projector's")
        w = gguf.dequantize(tensor)
        yield name, torch.from_numpy((w - 1 if tensor.name == _NORM_PLUS_ONE else w).copy())


def new_processor(path: str | Path, tokenizer: Any) -> Any:
    """transformers' Gemma 3 processor for the pair at `path` (its projector's image size, mean and std; the
    model file's tokenizer, which names its image tokens, and chat template)."""
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    mmproj = mmproj_for(path)
    assert mmproj is not None, f"{path} has no vision projector"
    meta, cfg = _meta(mmproj), config_dict(path, mmproj)
    size = int(meta["clip.vision.image_size"])
    images = Gemma3ImageProcessor(
        size={"height": size, "width": size},
        image_mean=list(meta.get("clip.vision.image_mean", [0.5] * 3)),
        image_std=list(meta.get("clip.vision.image_std", [0.5] * 3)),
    )
    boi, eoi, image = IMAGE_TOKENS
    # the names Gemma3Processor reads (`tokenizer.boi_token`, ...), which Gemma's tokenizer_config.json
    # holds and a GGUF file does not; transformers has no public setter
    tokenizer._set_model_specific_special_tokens({"boi_token": boi, "eoi_token": eoi, "image_token": image})
    return Gemma3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=cfg["mm_tokens_per_image"],
    )

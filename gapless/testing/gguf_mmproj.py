"""llama.cpp's vision projector file (`mmproj`) written from a tiny Gemma 3 vision-language checkpoint, for
tests: the yardstick for `gapless.model.gguf_vision`.

Written with the `gguf` package as llama.cpp's `convert_hf_to_gguf.py --mmproj` writes Gemma 3's
(`Gemma3VisionModel`): `general.architecture: clip`, the `clip.*` keys its writer names (projector type
`gemma3`, the tower's sizes, the text model's width as the projection's, the processor's mean and std,
the pooling's scale factor where it is not 4), tensor names from gguf's own `TensorNameMap` for
`MODEL_ARCH.MMPROJ`, the patch and position embeddings in F32, the input projection in F16, the projector
norm's weight plus 1, 1-D tensors in F32 and the other matrices in the chosen type.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file


def write_mmproj(ckpt: str | Path, out: str | Path, qtype: str = "F16") -> Path:
    """Write the vision tower and projector of the Gemma 3 checkpoint directory `ckpt` as a projector file
    `out`, its matrices in `qtype` (F32, F16 or a type gguf quantizes)."""
    ckpt, out = Path(ckpt), Path(out)
    cfg = json.loads((ckpt / "config.json").read_text())
    vision, text = cfg["vision_config"], cfg["text_config"]
    pre = json.loads((ckpt / "processor_config.json").read_text()).get("image_processor", {})
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(text["hidden_size"])
    writer.add_vision_image_size(vision["image_size"])
    writer.add_vision_patch_size(vision["patch_size"])
    writer.add_vision_embedding_length(vision["hidden_size"])
    writer.add_vision_feed_forward_length(vision["intermediate_size"])
    writer.add_vision_block_count(vision["num_hidden_layers"])
    writer.add_vision_head_count(vision["num_attention_heads"])
    writer.add_vision_image_mean(pre.get("image_mean", [0.5] * 3))
    writer.add_vision_image_std(pre.get("image_std", [0.5] * 3))
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
    writer.add_vision_use_gelu(True)
    scale = vision["image_size"] // vision["patch_size"] // round(cfg["mm_tokens_per_image"] ** 0.5)
    if scale != 4:
        writer.add_vision_projector_scale_factor(scale)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    kind = gguf.GGMLQuantizationType[qtype]
    for hf, w in load_file(str(ckpt / "model.safetensors")).items():
        hf = hf.removeprefix("model.")
        if hf.startswith("vision_tower."):  # (transformers writes it with or without `vision_model.`)
            hf = "vision_tower.vision_model." + hf.removeprefix("vision_tower.").removeprefix("vision_model.")
        elif not hf.startswith("multi_modal_projector."):
            continue
        name = names.get_name(hf.replace("_weight", ".weight"), try_suffixes=(".weight", ".bias"))
        assert name is not None, f"no GGUF name for {hf}"
        w = w.astype(np.float32)
        if name == "mm.soft_emb_norm.weight":
            w = w + 1
        if w.ndim == 1 or ".embeddings." in hf or kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w)
        elif "input_projection" in hf or kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out

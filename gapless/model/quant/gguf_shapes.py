"""What a GGUF file's header says checked before any weight is read (`gapless.model.gguf`): that its
tensors' bytes lie where their types and shapes put them (`check_layout`, llama.cpp's own rule), and that
each tensor the model reads has the shape the config from the file's metadata gives it (`check_shapes`).

A file written by hand or by a broken converter (an expert count, hidden size or width unlike its
metadata's, a matrix's dimensions swapped, a mixture's experts not stacked, a tensor's type changed in the
header) is refused in one line naming the tensor, its shape and the config's, not failed deep in a load
(an AttributeError, a concatenation's RuntimeError) or loaded as other weights than the file's.
"""

from __future__ import annotations

from typing import Any

# a tensor's shape (row-major, as Hugging Face holds it) in the config's dimensions (`_dims`), by its Hugging
# Face name without `model.` and a layer's `layers.{i}.`
_SHAPES: dict[str, tuple[str, ...]] = {
    "embed_tokens.weight": ("vocab", "hidden"),
    "lm_head.weight": ("vocab", "hidden"),
    "self_attn.q_proj.weight": ("q", "hidden"),
    "self_attn.k_proj.weight": ("kv", "hidden"),
    "self_attn.v_proj.weight": ("kv", "hidden"),
    "self_attn.qkv_proj.weight": ("q+2kv", "hidden"),  # (Phi-3's fused q/k/v)
    "self_attn.o_proj.weight": ("hidden", "q"),
    "self_attn.q_proj.bias": ("q",),
    "self_attn.k_proj.bias": ("kv",),
    "self_attn.v_proj.bias": ("kv",),
    "self_attn.q_norm.weight": ("head_dim",),
    "self_attn.k_norm.weight": ("head_dim",),
    "mlp.gate_proj.weight": ("width", "hidden"),
    "mlp.up_proj.weight": ("width", "hidden"),
    "mlp.gate_up_proj.weight": ("2 x width", "hidden"),  # (Phi-3's fused gate/up)
    "mlp.down_proj.weight": ("hidden", "width"),
    "mlp.gate.weight": ("experts", "hidden"),  # a mixture's router
    "mlp.experts.gate_proj.weight": ("experts", "expert width", "hidden"),
    "mlp.experts.up_proj.weight": ("experts", "expert width", "hidden"),
    "mlp.experts.down_proj.weight": ("experts", "hidden", "expert width"),
    "mlp.shared_expert.gate_proj.weight": ("shared expert width", "hidden"),
    "mlp.shared_expert.up_proj.weight": ("shared expert width", "hidden"),
    "mlp.shared_expert.down_proj.weight": ("hidden", "shared expert width"),
    "mlp.shared_expert_gate.weight": ("hidden",),  # (llama.cpp's: a vector)
}
_NORMS = ("norm.weight", "layernorm.weight")  # every RMSNorm but q/k's: one weight a hidden dimension
_EXPERTS = ("mlp.gate.weight", "mlp.experts.", "mlp.shared_expert")  # a routed layer's tensors
_DENSE = ("mlp.gate_proj.", "mlp.up_proj.", "mlp.gate_up_proj.", "mlp.down_proj.")  # a dense layer's


def _dims(cfg: dict[str, Any]) -> dict[str, int | None]:
    """The config's sizes (`gguf.config_dict`'s dict) by the names `_SHAPES` gives them (None: not in a
    model of this config)."""
    hd, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    width = cfg["intermediate_size"]
    expert_width = cfg.get("moe_intermediate_size", width if experts else None)  # (Mixtral's: the MLP's)
    return {
        "vocab": cfg["vocab_size"],
        "hidden": cfg["hidden_size"],
        "q": heads * hd,
        "kv": kv * hd,
        "q+2kv": (heads + 2 * kv) * hd,
        "head_dim": hd,
        "width": width,
        "2 x width": 2 * width,
        "experts": experts,
        "expert width": expert_width,
        "shared expert width": cfg.get("shared_expert_intermediate_size"),
    }


def _refusal(name: str, shape: tuple[int, ...], want: tuple[str, ...], dims: dict[str, Any]) -> str | None:
    """Why the tensor `name` (llama.cpp's) of row-major `shape` cannot be the config's `want`; None where it
    is (a vector may carry leading 1s)."""
    missing = [d for d in want if dims[d] is None]
    if missing:
        return (
            f"GGUF tensor {name} ({_shape(shape)}) takes a model with {' and '.join(missing)}, which the "
            "file's metadata does not give"
        )
    sizes = tuple(int(dims[d]) for d in want)
    found = shape[len(shape) - 1 :] if len(want) == 1 and all(n == 1 for n in shape[:-1]) else shape
    if found == sizes:
        return None
    return (
        f"GGUF tensor {name} is {_shape(shape)} (row-major), but the config from the file's metadata takes "
        f"{_shape(sizes)} ({', '.join(f'{d} {dims[d]}' for d in want)}): not the model its metadata "
        "describes"
    )


def _shape(shape: tuple[int, ...]) -> str:
    return f"[{', '.join(str(n) for n in shape)}]"


def check_shapes(tensors: Any, hf_names: dict[str, str], cfg: dict[str, Any]) -> None:
    """Refuse (ValueError, one line) the first of `tensors` (gguf's reader's) whose shape is not the one
    config `cfg` (`gguf.config_dict`'s) gives its Hugging Face name (`hf_names`, by llama.cpp name; a tensor
    without one, which the model does not read, is not checked): a layer beyond the config's, a mixture's
    tensor in a dense model's file or in a layer without a router (`ffn_gate_inp`), a dense MLP's in a
    layer with one, a dimension unlike the config's; and a routed layer without its experts."""
    dims, layers = _dims(cfg), int(cfg["num_hidden_layers"])
    routed = {int(n.split(".")[1]) for n in hf_names if n.startswith("blk.") and ".ffn_gate_inp." in n}
    for t in tensors:
        hf = hf_names.get(t.name)
        if hf is None:
            continue
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # (ggml's order is innermost first)
        key = hf.removeprefix("model.")
        if key.startswith("layers."):
            _, layer, key = key.split(".", 2)
            if int(layer) >= layers:
                raise ValueError(
                    f"GGUF tensor {t.name} is of layer {layer}, but the file's metadata gives the model "
                    f"{layers} layers (block_count)"
                )
            if dims["experts"] and key.startswith(_DENSE if int(layer) in routed else _EXPERTS):
                what, has = ("a dense MLP's", "a") if int(layer) in routed else ("a mixture's", "no")
                raise ValueError(f"GGUF tensor {t.name} is {what}, but layer {layer} has {has} router")
        want = _SHAPES.get(key) or (("hidden",) if key.endswith(_NORMS) else None)
        why = None if want is None else _refusal(t.name, shape, want, dims)
        if why is not None:
            raise ValueError(why)
    for i in sorted(routed):
        missing = [f"blk.{i}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
        missing = [name for name in missing if name not in hf_names]
        if missing:
            raise ValueError(f"layer {i} has a router (ffn_gate_inp), but the file has no {missing[0]}")


def check_layout(reader: Any, path: str) -> None:
    """Refuse (ValueError) a file whose tensors' bytes do not lie where the header's types and shapes put
    them: each tensor where the one before it ends (padded to the file's alignment), as llama.cpp requires
    (`gguf_init_from_file`), so a type changed in the header, read as that type, would be other weights.
    (Not seen: a type changed to another of the same bytes, F16 to BF16; or the last tensor's, since bytes
    after it are let be, as llama.cpp lets them.)"""
    start, align = int(reader.data_offset), int(reader.alignment)
    at, after = start, ""
    for t in reader.tensors:
        if int(t.data_offset) != at:
            raise ValueError(
                f"{path}: GGUF tensor {t.name} starts at byte {int(t.data_offset) - start:,} of the tensor "
                f"data, not at {at - start:,}{after}: a tensor's type or shape in the header is not what its "
                "bytes were written as (llama.cpp refuses the file too)"
            )
        at += -(-int(t.n_bytes) // align) * align
        after = f", where {t.name} ({t.tensor_type.name} {_shape(tuple(reversed(t.shape.tolist())))}) ends"

"""GGUF files (llama.cpp's format), read with the `gguf` package, the format's own library. A model split in
several files (`NAME-00001-of-00003.gguf` ...: llama.cpp's `gguf-split`, its converter's `--split-max-*`) is
read as one: the metadata from the first part, the tensors from every part (`split_parts`).

A GGUF file carries the config, the tokenizer and the weights in one file. This module turns each into
what the safetensors path already has: the metadata into a Hugging Face style `config.json` dict (which
`gapless.model.config` validates with the same rules as a checkpoint directory's), and the tensors into
Hugging Face names and layouts: dequantized to float32 (the loader casts them to the engine's dtype), or,
where the loader keeps them quantized (`gapless.model.quant.gguf_cpu`), quantized matrices as their blocks.
The tensor types read are F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K-Q6_K, the
i-quants IQ1_S-IQ4_XS, MXFP4 and the ternary TQ1_0/TQ2_0; a file holding another is refused by name with
its config, as is one whose tensors' shapes or bytes are not what its metadata and header say
(`gapless.model.quant.gguf_shapes`: a hand-written file's, a broken converter's).

The tokenizer and chat template are built by transformers from the same file
(`gapless.model.source.load_tokenizer`); sampling defaults, where the file has them (`general.sampling.*`,
written by newer llama.cpp converters from generation_config.json), are read back under their Hugging Face
names (`gapless.model.generation_config`).

llama.cpp's converter permutes the rows of the q and k projections of `llama` models (its RoPE pairs
neighbouring elements, Hugging Face's pairs the two halves of a head); `_unpermute` undoes that, as
transformers does when it loads a GGUF. The Qwen families are written unpermuted. Its converter stores Llama
3.x's `llama3` RoPE scaling as one divisor a frequency (`rope_freqs`), read as `freq_factors` scaling. A
mixture of experts (`qwen2moe`, `qwen3moe`, and Mixtral as `llama` with `expert_count`) stores each layer's
experts stacked, given one expert at a time.
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gapless.model.quant import gguf_shapes
from gapless.model.quant.gguf_blocks import FLOAT_TYPES, QUANTIZED_TYPES, GGUFBlocks

# general.architecture -> the Hugging Face architecture the one decoder runs it as. llama.cpp writes
# Mistral models as `llama` (same tensors; gapless refuses a real sliding window either way).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# a mixture of experts llama.cpp writes under a dense architecture's name (`expert_count` > 0): Mixtral
_MIXTURES = {"llama": "MixtralForCausalLM", "mistral": "MixtralForCausalLM"}
# whether llama.cpp renormalises the chosen experts' weights (its `norm_w`), where the file does not say
# (`expert_weights_norm`): Qwen3-MoE yes, Qwen2-MoE no (Mixtral always, whatever the config)
_NORM_TOPK = {"qwen3moe": True, "qwen2moe": False}
# float in every format gapless reads, quantized in a file or not: a mixture's router, its shared expert's
# gate (both tiny; llama.cpp's converter keeps them F32)
_ALWAYS_FLOAT = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")
_PERMUTED_QK = ("llama", "mistral")  # llama.cpp's converter permutes q/k rows of these

# llama.cpp tensor names -> Hugging Face names ("{}" is the layer index)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture's router
    "ffn_gate_exps": "mlp.experts.gate_proj",  # every expert's, stacked [experts, rows, cols]
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # Qwen2-MoE's shared expert, and its gate
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


# Gemma's norms (llama.cpp's names): an attention and an MLP norm on each side of its sublayer
_GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# each architecture's own names where they differ from `_LAYER_NAMES`: Phi-3's fused q/k/v and gate/up
_ARCH_NAMES = {
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# Gemma's: llama.cpp's converter stores every RMSNorm weight plus 1 (Gemma's norm multiplies by 1 + w)
_NORMS_PLUS_ONE = ("gemma2", "gemma3")
# llama.cpp's Gemma: every `pattern`-th layer global, the rest sliding (`set_swa_pattern`), the window
# layers' RoPE base (Gemma 3), and the 27B's layer count, whose queries it scales by hidden / heads
_GEMMA = {"gemma2": (2, None, 46), "gemma3": (6, 10000.0, 62)}

# llama.cpp's sampling metadata (`general.sampling.*`, written by newer converters) -> the
# generation_config.json names of the same defaults
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def is_gguf_file(path: str | Path) -> bool:
    """A file whose first four bytes are GGUF's magic (the name's suffix is not trusted either way)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


# a file of a model split in several (llama.cpp's `gguf-split`, and its converter's --split-max-*): the first
# holds the metadata, every one some tensors
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_parts(path: str | Path) -> list[Path]:
    """The files a GGUF model is in: `path` alone, or, where its name is a split's part
    (`NAME-00002-of-00003.gguf`), every part in order, the first first; a missing part is named."""
    path = Path(path)
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = ", ".join(p.name for p in parts if not p.is_file())
    if missing:
        raise ValueError(f"{path.name} is part of a model split in {count} files; missing: {missing}")
    return parts


def _readers(path: str | Path) -> list[Any]:
    """Each part's reader (`split_parts`), the first first."""
    return [_reader(str(p)) for p in split_parts(path)]


def tensors(path: str | Path) -> Iterator[Any]:
    """Every tensor of the model, across its parts (each part's layout checked as it is first read:
    `gguf_shapes.check_layout`; not where only its header's fields are, a projector's search among them)."""
    for part in split_parts(path):
        reader = _reader(str(part))
        if not getattr(reader, "layout_checked", False):
            gguf_shapes.check_layout(reader, str(part))
            reader.layout_checked = True
        yield from reader.tensors


def _reader(path: str) -> Any:
    """The file's reader, shared by the config and weight reads of one load (and keyed by the file's
    size and mtime, so a file rewritten in place is read afresh)."""
    st = Path(path).stat()
    return _open(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _open(path: str, size: int, mtime_ns: int) -> Any:
    from gguf import GGUFReader  # memory-maps the file: opening it reads only the header

    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, struct.error) as e:  # (what gguf raises)
        raise ValueError(
            f"{path}: not a whole GGUF file ({size:,} bytes; gguf's reader: {e}): a copy or download cut "
            "short, or a tensor's type in its header unlike its shape?"
        ) from None


def metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata field of the file (of a split model's first part, which holds them) as a Python
    value (strings, numbers, lists)."""
    return {name: f.contents() for name, f in _readers(path)[0].fields.items()}


def field(path: str | Path, key: str) -> Any:
    """One metadata field of this one file (a split model's part too, from its own header) as a Python
    value; None where the file has none. Cheaper than `metadata`, which converts every field (a real
    vocabulary's token list among them)."""
    found = _reader(str(path)).fields.get(key)
    return None if found is None else found.contents()


def tensor_names(path: str | Path) -> set[str]:
    return {t.name for t in tensors(path)}


def quantized_types(path: str | Path) -> dict[str, str]:
    """Each quantized matrix's type by its Hugging Face name (an expert's one at a time), from the file's
    header (no weight read); not a router's, which loads as a float."""
    types = {}
    arch = metadata(path)["general.architecture"]
    for t in tensors(path):
        name = hf_name(t.name, arch)
        if name is None or not _as_blocks(t, name, True):
            continue
        experts = int(t.shape[2]) if len(t.shape) == 3 else 0
        for one in [_expert_name(name, e) for e in range(experts)] if experts else [name]:
            types[one] = t.tensor_type.name
    return types


def _rope_scaling(
    path: str | Path, meta: dict[str, Any], arch: str, names: set[str]
) -> dict[str, Any] | None:
    """The file's RoPE scaling as `config.json`'s `rope_scaling` takes it: linear/yarn-style metadata, or
    llama.cpp's per-frequency factors (`rope_freqs`, how its converter stores Llama 3.x's `llama3`
    scaling: each frequency divided by its factor) as gapless's `freq_factors`."""
    if "rope_factors_long.weight" in names:  # (Phi-3's 128k models)
        raise ValueError(
            f"{path}: LongRoPE scaling (rope_factors_long/short) is not supported: its factors switch by "
            "sequence length, which a batch of requests of different lengths cannot follow token-exactly"
        )
    if "rope_freqs.weight" in names:
        factors = next(t for t in tensors(path) if t.name == "rope_freqs.weight")
        return {"rope_type": "freq_factors", "factors": [float(f) for f in dequantize(factors).reshape(-1)]}
    key = f"{arch}.rope.scaling."
    kind = meta.get(key + "type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(meta.get(key + "factor", 1.0))}
    if key + "original_context_length" in meta:
        scaling["original_max_position_embeddings"] = int(meta[key + "original_context_length"])
    return scaling


def config_dict(path: str | Path) -> dict[str, Any]:
    """The file's metadata as the `config.json` dict a Hugging Face checkpoint of it would carry.

    Raises ValueError naming the architecture when it is not one gapless runs, what of a mixture of
    experts or RoPE scaling it does not compute, a metadata key it needs and lacks, and a tensor whose
    shape is not the config's (`gguf_shapes.check_shapes`).
    """
    try:
        cfg = _config_dict(path)
    except KeyError as e:
        raise ValueError(
            f"{path}: its GGUF metadata has no {e.args[0]}, which its model's config needs"
        ) from None
    arch = metadata(path)["general.architecture"]
    hf_names = {t.name: hf_name(t.name, arch) for t in tensors(path)}
    gguf_shapes.check_shapes(tensors(path), {k: v for k, v in hf_names.items() if v}, cfg)
    return cfg


def _config_dict(path: str | Path) -> dict[str, Any]:
    meta, names = metadata(path), tensor_names(path)
    _check_types(path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path}; gapless runs GGUF files of "
            f"{', '.join(ARCHITECTURES)}"
        )
    hidden, heads = int(meta[f"{arch}.embedding_length"]), int(meta[f"{arch}.attention.head_count"])
    rotated = meta.get(f"{arch}.rope.dimension_count")  # (Phi-3's: a head's first dimensions alone)
    head_dim = meta.get(f"{arch}.attention.key_length") or (None if arch == "phi3" else rotated)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:  # the embedding table's rows: the shape is in ggml order, [hidden, vocab]
        vocab = next((int(t.shape[-1]) for t in tensors(path) if t.name == "token_embd.weight"), None)
    if vocab is None:
        raise ValueError(f"{path}: no {arch}.vocab_size, tokenizer.ggml.tokens nor token_embd.weight")
    rope_scaling = _rope_scaling(path, meta, arch, names)
    head_dim = int(head_dim) if head_dim else hidden // heads
    if rope_scaling is not None and len(rope_scaling.get("factors", [0] * (head_dim // 2))) != head_dim // 2:
        raise ValueError(
            f"{path}: rope_freqs holds {len(rope_scaling['factors'])} factors; a head of {head_dim} takes "
            f"{head_dim // 2}"
        )
    mixture = _mixture(path, meta, arch, names)
    architecture = _MIXTURES[arch] if mixture and arch in _MIXTURES else ARCHITECTURES[arch]
    family = mixture | _gemma(meta, arch, hidden, heads, head_dim)
    return {
        "architectures": [architecture],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": int(meta[f"{arch}.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "partial_rotary_factor": int(rotated or head_dim) / head_dim,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "use_sliding_window": False,
        "sliding_window": meta.get(f"{arch}.attention.sliding_window") if arch == "phi3" else None,
    } | family


def _gemma(meta: dict[str, Any], arch: str, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """Gemma 2's and 3's config fields ({} for another architecture), as llama.cpp runs the file: its
    window and which layers slide (`sliding_window_pattern`, else every second / sixth layer global), the
    soft-caps it stores (Gemma 2), the queries' scale (1 / sqrt(head_dim), the 27B's 1 / sqrt(hidden /
    heads): the file does not say; llama.cpp tells the 27B by its layer count) and the window layers' RoPE
    base (Gemma 3's, 10,000, unscaled)."""
    if arch not in _GEMMA:
        return {}
    pattern, local_base, layers_27b = _GEMMA[arch]
    layers = int(meta[f"{arch}.block_count"])
    fields: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if layers == layers_27b else head_dim,
        "attn_logit_softcapping": meta.get(f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping"),
    }
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:
        fields["sliding_window"] = int(window)
        stored = meta.get(f"{arch}.attention.sliding_window_pattern", pattern)
        if isinstance(stored, list):  # (a flag a layer: whether it slides)
            fields["layer_types"] = ["sliding_attention" if s else "full_attention" for s in stored]
        else:
            fields["sliding_window_pattern"] = int(stored)
    if local_base is not None:
        fields["rope_local_base_freq"] = local_base
    return fields


def _mixture(path: str | Path, meta: dict[str, Any], arch: str, names: set[str]) -> dict[str, Any]:
    """A mixture of experts' config fields ({} for a dense model): the experts (`expert_count`, and
    `expert_used_count` a token), their width, the shared expert's (Qwen2-MoE), the layers without a router
    (`mlp_only_layers`) and whether the chosen weights are renormalised (llama.cpp's rule for the
    architecture where the file does not say). Refuses what gapless's routers do not compute."""
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if not experts:
        if arch in _NORM_TOPK:
            raise ValueError(f"{path}: a {arch} file without {arch}.expert_count")
        return {}
    if arch not in _NORM_TOPK and arch not in _MIXTURES:
        raise ValueError(f"{arch}: mixture-of-experts (expert_count={experts}) is not supported")
    gating = int(meta.get(f"{arch}.expert_gating_func", 1))
    if gating != 1:  # (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 1 softmax, 2 sigmoid, ...)
        raise ValueError(f"{arch}: expert_gating_func {gating} is not supported; gapless routes by softmax")
    layers = int(meta[f"{arch}.block_count"])
    # (ggml's shapes run innermost first: ffn_gate_exps is [hidden, width, experts])
    experts_of = ("_exps.weight", "_shexp.weight")  # (the shared expert's gate, `_inp_shexp`, is a vector)
    widths = {
        t.name: int(t.shape[1]) for t in tensors(path) if t.name.endswith(experts_of) and len(t.shape) > 1
    }
    routed = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
    if not routed:
        raise ValueError(f"{path}: expert_count={experts} but no layer has a router (ffn_gate_inp)")
    if arch in _MIXTURES:  # Mixtral's experts are feed_forward_length wide, every layer routed
        return {"num_local_experts": experts, "num_experts_per_tok": int(meta[f"{arch}.expert_used_count"])}
    width = meta.get(f"{arch}.expert_feed_forward_length") or widths.get(
        f"blk.{routed[0]}.ffn_gate_exps.weight"
    )
    if width is None:
        raise ValueError(f"{path}: no {arch}.expert_feed_forward_length, nor blk.{routed[0]}.ffn_gate_exps")
    fields: dict[str, Any] = {
        "num_experts": experts,
        "num_experts_per_tok": int(meta[f"{arch}.expert_used_count"]),
        "moe_intermediate_size": int(width),
        "mlp_only_layers": [i for i in range(layers) if i not in routed],
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", _NORM_TOPK[arch])),
    }
    shared = f"blk.{routed[0]}.ffn_up_shexp.weight"
    if shared in widths:
        width = meta.get(f"{arch}.expert_shared_feed_forward_length") or widths[shared]
        fields["shared_expert_intermediate_size"] = int(width)
    return fields


def tensor_types(path: str | Path) -> dict[str, str]:
    """Each tensor's type name (F32, Q4_1, ...), by llama.cpp tensor name."""
    return {t.name: t.tensor_type.name for t in tensors(path)}


def _check_types(path: str | Path) -> None:
    """Refuse, by name, tensor types gapless does not read."""
    known = FLOAT_TYPES + QUANTIZED_TYPES
    bad = {kind: name for name, kind in tensor_types(path).items() if kind not in known}
    if bad:
        kinds = ", ".join(f"{kind} (e.g. {name})" for kind, name in sorted(bad.items()))
        raise ValueError(
            f"GGUF tensor type {kinds} in {path} is not supported; gapless reads {', '.join(known)}"
        )


def generation_config_dict(path: str | Path) -> dict[str, Any]:
    """The file's sampling defaults under their `generation_config.json` names; {} when it has none."""
    meta = metadata(path)
    return {name: meta[key] for key, name in _SAMPLING_KEYS.items() if key in meta}


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor name in a file of `arch`; None for tensors the model has
    no use for."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")  # blk.{i}.{kind}.{weight|bias}
    names = _LAYER_NAMES | _ARCH_NAMES.get(arch, {})
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, its rows were interleaved as (pair, half)."""
    rest = w.shape[1:]
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor: Any) -> np.ndarray:
    """One tensor of the file as float32 in numpy (row-major, Hugging Face) order."""
    from gguf import GGMLQuantizationType, quants

    if tensor.tensor_type == GGMLQuantizationType.F32:
        return np.asarray(tensor.data, dtype=np.float32)
    return quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)


def _as_blocks(tensor: Any, name: str, keep_quantized: bool) -> bool:
    """Whether `iter_weights` gives the tensor as its blocks (else dequantized)."""
    quantized = keep_quantized and tensor.tensor_type.name in QUANTIZED_TYPES and len(tensor.shape) >= 2
    return quantized and not name.endswith(_ALWAYS_FLOAT)


def _expert_name(stacked: str, expert: int) -> str:
    """One expert's name in a stacked experts tensor's (`...mlp.experts.gate_proj.weight`)."""
    return stacked.replace(".experts.", f".experts.{expert}.")


def iter_weights(
    path: str | Path, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """(Hugging Face name, float32 tensor) for each tensor the model uses, q/k rows unpermuted, a
    mixture's stacked experts one expert at a time (`...experts.3.gate_proj.weight`, as a checkpoint
    stores them); with `keep_quantized`, a quantized matrix comes as its blocks (`GGUFBlocks`, rows in the
    same order), the embedding table and LM head too (a router never)."""
    meta = metadata(path)
    arch = meta["general.architecture"]
    heads = int(meta[f"{arch}.attention.head_count"])
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    for tensor in tensors(path):
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        kind = tensor.tensor_type.name
        blocks = _as_blocks(tensor, name, keep_quantized)
        rows = int(np.prod([int(n) for n in tensor.shape[1:]]))
        # the blocks of a row are its bytes: as [rows, bytes per row] they permute like the weights
        w = np.asarray(tensor.data).reshape(rows, -1) if blocks else dequantize(tensor)
        if arch in _PERMUTED_QK and ".attn_q." in tensor.name:
            w = _unpermute(w, heads)
        elif arch in _PERMUTED_QK and ".attn_k." in tensor.name:
            w = _unpermute(w, kv_heads)
        elif name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # (llama.cpp's is a vector; Hugging Face's a [1, hidden] linear)
        elif arch in _NORMS_PLUS_ONE and name.endswith("norm.weight"):
            w = w - 1
        if len(tensor.shape) == 3:  # a mixture's experts, [experts, rows, cols]: one matrix each
            count = int(tensor.shape[2])
            per = w.reshape(count, rows // count, -1)
            for e in range(count):
                yield _expert_name(name, e), _matrix(per[e], kind, int(tensor.shape[0]), blocks)
            continue
        # (an embedding table's blocks are read where they lie: `gguf_cpu.FileRows` reads a lookup's rows)
        yield (
            name,
            _matrix(w, kind, int(tensor.shape[0]), blocks, copy=not name.endswith("embed_tokens.weight")),
        )


def _matrix(
    w: np.ndarray, kind: str, cols: int, blocks: bool, copy: bool = True
) -> torch.Tensor | GGUFBlocks:
    """One matrix as `iter_weights` gives it: its blocks, a plain array unless not `copy` (else the memory
    map's pages), or a float32 tensor."""
    if blocks:
        return GGUFBlocks(kind, cols, np.array(w) if copy else w)
    return torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=not w.flags.writeable))

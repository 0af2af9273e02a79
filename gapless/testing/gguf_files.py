"""GGUF files written from the tiny Hugging Face checkpoints, for tests: the yardstick for the GGUF reader.

Written with the `gguf` package as llama.cpp's `convert_hf_to_gguf.py` writes them: the metadata keys its
writer names, tensor names from gguf's own `TensorNameMap` (not gapless's table), llama's q/k rows
permuted as llama.cpp permutes them, Llama 3.x's RoPE scaling as its `rope_freqs` factors, a mixture's
experts stacked, 1-D tensors (norms, biases) and routers kept in F32 and matrices stored in the chosen
type, and the byte-level BPE tokenizer as `tokenizer.ggml.*` (tokens, types, merges, special ids, chat
template), and the sampling defaults of its `generation_config.json` as `general.sampling.*`.
transformers reads the same file (`from_pretrained(dir, gguf_file=...)`) as the reference (where it
reads the file's RoPE scaling and experts: else the checkpoint it was written from).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from gapless.model.quant.gguf_blocks import GGUFBlocks
from gapless.model.vision import text_weight_name
from gapless.model.vision.gemma3 import gemma3_text_config

# Hugging Face architecture -> llama.cpp's (Mistral is written as llama)
ARCHS = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA,  # (llama with experts, as llama.cpp writes Mixtral)
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "Qwen2MoeForCausalLM": gguf.MODEL_ARCH.QWEN2MOE,
    "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
    "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
    "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
}
_GEMMA = (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (`LlamaModel.permute` in convert_hf_to_gguf.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _add_tokenizer(writer: gguf.GGUFWriter, ckpt: Path) -> None:
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(special)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids must be dense"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(merges)
    eos = special[cfg["eos_token"]]
    writer.add_bos_token_id(special[cfg.get("bos_token") or cfg["eos_token"]])
    writer.add_eos_token_id(eos)
    writer.add_pad_token_id(special[cfg.get("pad_token") or cfg["eos_token"]])
    writer.add_add_bos_token(False)
    template = cfg.get("chat_template")
    if template is None and (ckpt / "chat_template.jinja").is_file():
        template = (ckpt / "chat_template.jinja").read_text()
    if template:
        writer.add_chat_template(template)


def _global_rope(cfg: dict) -> dict:
    """The checkpoint's RoPE parameters (Gemma 3's: its global layers'; llama.cpp fixes the others')."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return rope.get("full_attention", rope)


def _add_config(writer: gguf.GGUFWriter, cfg: dict, name: str) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = _global_rope(cfg)
    writer.add_name(name)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg["vocab_size"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if cfg.get("sliding_window") and writer.arch in ("gemma2", "gemma3", "phi3"):  # (its converter's)
        writer.add_sliding_window(cfg["sliding_window"])
    for key, add in (
        ("attn_logit_softcapping", writer.add_attn_logit_softcapping),
        ("final_logit_softcapping", writer.add_final_logit_softcapping),
    ):
        if writer.arch == "gemma2" and cfg.get(key) is not None:
            add(cfg[key])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:  # (Mixtral's experts are feed_forward_length wide, Qwen's expert_feed_forward_length)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _add_sampling(writer: gguf.GGUFWriter, ckpt: Path) -> None:
    """The checkpoint's sampling defaults (`generation_config.json`) as `general.sampling.*`, as
    convert_hf_to_gguf.py writes them; nothing for a checkpoint without any."""
    path = ckpt / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    adders = {
        "temperature": writer.add_sampling_temp,
        "top_p": writer.add_sampling_top_p,
        "top_k": writer.add_sampling_top_k,
        "min_p": writer.add_sampling_min_p,
        "repetition_penalty": writer.add_sampling_penalty_repeat,
    }
    for name, add in adders.items():
        if gen.get(name) is not None:
            add(gen[name])


# one expert's projection in a checkpoint (Qwen's names, Mixtral's w1/w2/w3)
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
# kept in F32 whatever the type, as convert_hf_to_gguf.py keeps them: routers and the shared expert's gate
_F32_ALWAYS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def _stacked(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint's tensors with each layer's per-expert projections stacked, [experts, rows, cols],
    under the experts' name (`...experts.gate_proj.weight`), as llama.cpp's converter stacks them."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, w in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = w
        else:
            experts.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = w
    for name, by_id in experts.items():
        out[name] = np.stack([by_id[e] for e in range(len(by_id))])
    return out


def write_gguf(
    ckpt: str | Path,
    out: str | Path,
    qtype: str = "F32",
    split_tensors: int = 0,
    edits: dict[str, Callable[[np.ndarray], np.ndarray | None]] | None = None,
) -> Path:
    """Write the checkpoint directory `ckpt` (one safetensors file) as a GGUF file `out`, its matrices in
    `qtype` (one of TYPES); with `split_tensors`, split as llama.cpp's converter splits a model, at most
    that many tensors a file (`out`'s stem + `-00001-of-0000N.gguf` ...; the first file returned).
    `edits` (by GGUF name: a broken converter's file, for tests of its refusal): each such tensor, as its
    row-major float32 array about to be written, replaced by what its function returns (None: left out)."""
    ckpt, out = Path(ckpt), Path(out)
    cfg = json.loads((ckpt / "config.json").read_text())
    # a vision-language checkpoint: its decoder, as llama.cpp's converter writes it (the tower and
    # projector go to their own file: `gapless.testing.gguf_mmproj`)
    vision = "text_config" in cfg
    if vision:
        cfg = {**gemma3_text_config(cfg["text_config"]), "architectures": ["Gemma3ForCausalLM"]}
    arch = ARCHS[cfg["architectures"][0]]
    rope = _global_rope(cfg)
    if rope.get("rope_type", "default") not in ("default", "llama3", "linear"):
        raise ValueError(f"llama.cpp's converter writes no {rope['rope_type']!r} RoPE scaling")
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch], split_max_tensors=split_tensors)
    _add_config(writer, cfg, f"tiny-{gguf.MODEL_ARCH_NAMES[arch]}")
    _add_tokenizer(writer, ckpt)
    _add_sampling(writer, ckpt)
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    kind = gguf.GGMLQuantizationType[qtype]
    for hf, w in _stacked(load_file(str(ckpt / "model.safetensors"))).items():
        if vision and "language_model." not in hf:
            continue
        name = names.get_name(text_weight_name(hf), try_suffixes=(".weight", ".bias"))
        assert name is not None, f"no GGUF name for {hf}"
        w = w.astype(np.float32)
        if arch in _GEMMA and name.endswith("norm.weight"):
            w = w + 1  # (its converter's: llama.cpp's RMSNorm multiplies by the weight, Gemma's by 1 + it)
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = _permute(w, heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = _permute(w, kv_heads)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            w = w.reshape(-1)  # ([1, hidden]: llama.cpp's model takes it as a vector)
        if edits and name in edits:
            edited = edits[name](w)
            if edited is None:
                continue
            w = np.ascontiguousarray(edited)
        if w.ndim == 1 or kind == gguf.GGMLQuantizationType.F32 or name.endswith(_F32_ALWAYS):
            writer.add_tensor(name, w)
        elif kind == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_factors(cfg, rope))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return writer.format_shard_names(out)[0]


def retype(path: str | Path, name: str, qtype: str) -> None:
    """Change, in place, the type the header of the GGUF file `path` gives its tensor `name` to `qtype`,
    its bytes and shape kept (a file written wrong, for tests of its refusal)."""
    reader = gguf.GGUFReader(str(path), "r+")
    tensor = next(t for t in reader.tensors if t.name == name)
    # (a tensor's header field's parts: name length, name, dims, shape, type, offset)
    tensor.field.parts[4][0] = gguf.GGMLQuantizationType[qtype]
    reader.data.flush()


def _llama3_factors(cfg: dict, rope: dict) -> np.ndarray:
    """Llama 3.x's `llama3` RoPE scaling as llama.cpp's converter stores it (`rope_freqs`): each frequency's
    divisor, 1 above the high-frequency band, `factor` below the low one, the smooth blend's between."""
    heads = cfg["num_attention_heads"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blend))
    return factors.astype(np.float32)


# where each type keeps its f16 fields (bytes into a block): the scale (and min) of the block (IQ1_M's is
# spread over four nibbles: `_iq1_m_scales`)
_F16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82]}
_F16_AT |= {"Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
_F16_AT |= {t: [0] for t in ("IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S")}
_F16_AT |= {"TQ1_0": [52], "TQ2_0": [64]}


def _iq1_m_scales(data: np.ndarray, d: np.ndarray) -> None:
    """IQ1_M's f16 scale `d` written into its blocks (`data` [..., 56]): its 16 bits a nibble in the top
    of each of the four scale words (bytes 48-55), their other bits kept."""
    words = data[..., 48:56].copy().view(np.uint16)
    nibbles = (d.view(np.uint16)[..., None] >> np.arange(0, 16, 4, dtype=np.uint16)) & 15
    data[..., 48:56] = ((words & 0x0FFF) | (nibbles << 12)).view(np.uint8)


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> GGUFBlocks:
    """Random, valid blocks of `qtype` (every quantized type, the K- and i-quants included, which gguf-py
    cannot quantize): random bytes with each block's f16 scales (MXFP4's e8m0 one) set to small finite
    values, so the weights are about as small as a checkpoint's (|w| < ~0.1)."""
    kind = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    # a K- or i-quant's weight is its f16 scale times a sub-scale times q (IQ4_NL's q up to 127, IQ2's 43):
    # smaller f16 scales
    if qtype.endswith("_K") or qtype in ("IQ4_XS", "IQ3_XXS", "IQ3_S"):
        low, high = 1e-5, 1e-4
    elif qtype.startswith(("IQ4", "IQ2")):
        low, high = 1e-4, 1e-3
    else:
        low, high = 1e-3, 1e-2
    if qtype == "IQ1_M":
        _iq1_m_scales(data, rng.uniform(low, high, (rows, cols // block)).astype(np.float16))
    if qtype == "MXFP4":  # an e8m0 byte: half its power of two, 2^(e - 128), times values up to 12
        data[..., 0] = rng.integers(114, 122, (rows, cols // block), dtype=np.uint8)
    for at in _F16_AT.get(qtype, []):
        values = rng.uniform(low, high, (rows, cols // block)).astype(np.float16)
        data[..., at : at + 2] = values.view(np.uint8).reshape(rows, cols // block, 2)
    return GGUFBlocks(qtype, cols, data.reshape(rows, -1))


def q4_k_m_type(name: str, layers: int) -> str:
    """The type llama.cpp's Q4_K_M gives a matrix (`llama_tensor_get_type`, its "use more bits" rule): Q6_K
    for the output and for attn_v and ffn_down (a mixture's ffn_down_exps too) in the first and last eighth
    of the layers and every third between, Q4_K for the rest."""
    if name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")):
        i = int(name.split(".")[1])
        if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2:
            return "Q6_K"
    return "Q4_K"


def write_random_gguf(ckpt: str | Path, out: str | Path, qtype: str = "Q4_K_M") -> Path:
    """A GGUF file `out` of the config and tokenizer in `ckpt` (no weights needed) with random weights: every
    matrix random blocks of `qtype` (`random_blocks`), or "Q4_K_M" llama.cpp's mix of Q4_K and Q6_K
    (`q4_k_m_type`), a mixture's experts stacked, its routers random F32, the norms ones. Written a tensor
    at a time (a model's size on disk, not in memory): for benchmarks of a model's shape as a GGUF file
    holds it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt, out = Path(ckpt), Path(out)
    cfg = json.loads((ckpt / "config.json").read_text())
    arch = ARCHS[cfg["architectures"][0]]
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt))
    shapes: dict[str, tuple[int, ...]] = {}
    for k, v in hf.state_dict().items():
        if k.endswith(".experts.gate_up_proj"):  # transformers' fused experts: llama.cpp's gate and up
            e, rows, cols = v.shape
            shapes |= {
                f"{k[: -len('gate_up_proj')]}{p}.weight": (e, rows // 2, cols)
                for p in ("gate_proj", "up_proj")
            }
        elif k.endswith(".experts.down_proj"):
            shapes[f"{k}.weight"] = tuple(v.shape)
        else:
            shapes[k] = tuple(v.shape)
    if cfg.get("tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    _add_config(writer, cfg, f"random-{gguf.MODEL_ARCH_NAMES[arch]}")
    _add_tokenizer(writer, ckpt)
    _add_sampling(writer, ckpt)
    plan = []  # (GGUF name, shape, type or None: F32 ones)
    for hf_name, shape in shapes.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"no GGUF name for {hf_name}"
        kind = None
        if len(shape) >= 2 and not name.endswith(_F32_ALWAYS):
            kind = q4_k_m_type(name, cfg["num_hidden_layers"]) if qtype == "Q4_K_M" else qtype
        plan.append((name, shape, kind))
        if kind is None:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            raw = gguf.GGMLQuantizationType[kind]
            block, size = gguf.GGML_QUANT_SIZES[raw]
            if shape[-1] % block:
                raise ValueError(f"{hf_name} {shape}: {kind} takes rows of whole {block}-weight blocks")
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for seed, (name, shape, kind) in enumerate(plan):
        if kind is not None:
            rows = int(np.prod(shape[:-1]))
            writer.write_tensor_data(random_blocks(kind, rows, shape[-1], seed).data.reshape(*shape[:-1], -1))
        elif name.endswith("ffn_gate_inp.weight"):  # a router: logits of about unit size, clear choices
            writer.write_tensor_data((rng.standard_normal(shape) / shape[-1] ** 0.5).astype(np.float32))
        else:
            writer.write_tensor_data(np.ones(shape, np.float32))
    writer.close()
    return out

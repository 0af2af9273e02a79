"""Load a model: a Hugging Face checkpoint directory (config.json + single or sharded *.safetensors) or a GGUF
file (read by `gapless.model.gguf`). Both yield Hugging Face names and layouts, so one loop places either. A
GGUF file's quantized matrices stay quantized: on a CPU with one rank in `gapless.model.quant.gguf_cpu`'s
layers, on a GPU and with tensor parallelism on the int4/int8 path (`gapless.model.quant.gguf_int4`);
`GAPLESS_GGUF_WEIGHTS=dequantize` dequantizes them to the model's dtype. A checkpoint whose
`quantization_config` names AWQ, GPTQ or compressed-tensors `pack-quantized`/`int-quantized` keeps its
int4/int8 projections quantized on every device and with tensor parallelism (`gapless.model.quant.int4`); a
scheme it does not run is refused before any weight is read."""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from gapless import env
from gapless.memory.kv_pool import FP8_DTYPES
from gapless.model import gguf, gguf_vision, parallel, weight_names
from gapless.model.config import ModelConfig, load_model_config
from gapless.model.cpu_gemm import pack_cpu_gemms
from gapless.model.decoder import CausalLM
from gapless.model.gguf import is_gguf_file
from gapless.model.int4_loading import Int4Layers
from gapless.model.kv_scales import KVScaleReader
from gapless.model.layers import (
    ParallelLMHead,
    VocabParallelEmbedding,
    _Linear,
    default_weight_loader,
    deferred_weights,
    is_placeholder,
    materialize,
)
from gapless.model.moe import Experts
from gapless.model.quant import (
    bnb,
    declared,
    formats,
    gguf_cpu,
    gguf_int4,
    int4,
    int4_kernels,
    int4_layouts,
    weights_summary,
)
from gapless.model.quant.checkpoint_checks import ScaleCheck, check_fp8_dtype
from gapless.model.quant.formats import QuantSpec
from gapless.model.quant.fp8 import SCALE_NAMES, checkpoint_scale
from gapless.model.quant.gguf_blocks import GGUFBlocks
from gapless.model.quant.gguf_int4 import GGUFLayers
from gapless.model.vision import VisionEncoder, new_encoder, text_weight_name
from gapless.model.weight_files import safetensors_files

log = logging.getLogger(__name__)

# the first part of a bare decoder body's weight names (a checkpoint saved from `Qwen3Model`, not from
# `Qwen3ForCausalLM`); gapless's are under `model.`
_BODY_PARTS = frozenset({"embed_tokens", "layers", "norm"})
GGUF_ENV = env.GGUF_WEIGHTS.name  # "dequantize": GGUF matrices as float weights; default "quantized"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(
    dtype: str | torch.dtype,
    cfg: ModelConfig,
    device: torch.device,
    path: str | Path | None = None,
    quantization: str | None = None,
) -> torch.dtype:
    """`auto` means the checkpoint's dtype on an accelerator and float32 on the CPU (where bf16 is slow);
    but an int4 checkpoint at `path` (its format: `quant_spec(path, quantization)`) saved in float16 runs
    in bfloat16 on a GPU where torch's int4 decode GEMM takes its layers in that dtype alone
    (`int4_kernels.wants_bfloat16`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        chosen = _DTYPES.get(cfg.torch_dtype or "bfloat16", torch.bfloat16)
        spec = quant_spec(path, quantization, device) if chosen == torch.float16 and path else None
        if spec is not None and int4_kernels.wants_bfloat16(spec.weight_only, device):
            log.info(
                "dtype auto: bfloat16, not the checkpoint's float16, for torch's int4 decode GEMM "
                "(tinygemm: bfloat16 only); --dtype float16 keeps float16 (the Triton GEMM at every row)"
            )
            return torch.bfloat16
        return chosen
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def gguf_kept(path: Path, device: torch.device) -> str:
    """How a load of `path` keeps a GGUF file's quantized matrices: "cpu" on a CPU with one rank
    (`gguf_cpu`'s layers, the embedding table read from the file), "int4" on a GPU, across ranks or under
    `GAPLESS_GGUF_LAYOUT=groups` (the projections and the LM head on the int4/int8 path, the table as its
    blocks: `gguf_int4`), or "" (not a GGUF file, or `GAPLESS_GGUF_WEIGHTS=dequantize`: every matrix a
    float weight)."""
    if not is_gguf_file(path) or env.GGUF_WEIGHTS.get() == "dequantize":
        return ""
    one_rank_cpu = device.type == "cpu" and parallel.current().size == 1
    return "cpu" if one_rank_cpu and gguf_cpu.layout() != "groups" else "int4"


def iter_weights(path: Path, gguf_blocks: str = "") -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """Each weight of a checkpoint directory or a GGUF file, under its Hugging Face name; a checkpoint's
    with a progress bar on stderr (by bytes read: a big model loads for minutes, and the bar shows it
    moving). A GGUF file's quantized matrices come as their blocks as `gguf_blocks` (`gguf_kept`) says;
    its vision projector's tensors (`gguf_vision`), where it has one, as float32."""
    if is_gguf_file(path):
        yield from gguf.iter_weights(path, bool(gguf_blocks))
        mmproj = gguf_vision.mmproj_for(path)
        if mmproj is not None:
            yield from gguf_vision.iter_weights(mmproj)
        return
    files = safetensors_files(path)
    with tqdm(
        total=sum(f.stat().st_size for f in files), desc="loading weights", unit="B", unit_scale=True
    ) as bar:
        done = 0
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    bar.update(tensor.nbytes)
                    yield name, tensor
            done += file.stat().st_size
            bar.update(done - bar.n)  # the file's header


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    quantization: str | None = None,
    dummy: bool = False,
) -> CausalLM:
    """The checkpoint's model in `dtype` on `device`; `max_positions` as `CausalLM` takes it. A quantized
    checkpoint (its config.json's `quantization_config`) or `quantization` (`--quantization`) loads its
    layers in that format (`gapless.model.quant.formats`), refused in one line before any weight loads
    where it cannot run. `dummy`: random weights, none read (`--load-format dummy`, for benchmarks)."""
    path = Path(path)
    cfg = load_model_config(path)
    parallel.check_shardable(cfg, parallel.current().size)
    spec = quant_spec(path, quantization, device)
    int4_spec = spec.weight_only if spec is not None else None
    int4_kernels.check_load(int4_spec, dtype, device)  # (GAPLESS_INT4_KERNEL's library, if it names one)
    with _default_dtype(dtype), torch.device(device), deferred_weights():
        model = CausalLM(cfg, max_positions)  # (a layer's weight takes memory as a float tensor loads)
    scheme, quantized = _prepare_quantized(model, spec, path, dummy, device)
    # float weights quantized as their layers load whole: `--quantization fp8`'s, bitsandbytes 4-bit's kept
    rounded = spec is not None and (spec.online or spec.scheme == "bnb")
    rounding = _OnlineRounding(model, scheme, spec, quantized if rounded else [])
    expected = weight_names.expected(model)  # (before an online load's rounding adds its layers' scales)
    int4_kernel = _int4_kernel(model, int4_spec, dtype, device) if int4_spec is not None else ""
    int4_layers = Int4Layers(model, int4_spec, dtype, int4_kernel) if int4_spec is not None else None
    loaded: set[str] = set()
    encoder = new_encoder(cfg.vision, cfg.hidden_size, dtype, device) if cfg.vision is not None else None
    kv_scales, scale_check = KVScaleReader(), ScaleCheck()  # an FP8 KV cache's scales; weights' checked
    kept = gguf_kept(path, device)
    gguf_layers = _gguf_layers(model, path, kept, dtype)  # (None: no GGUF blocks)
    weights: Iterable[tuple[str, Any]] = [] if dummy else iter_weights(path, kept)
    if spec is not None and spec.scheme == "bnb" and not spec.online:
        weights = bnb.dequantized(weights, device)  # (its 4-bit weights read as floats)
    for name, tensor in weights:
        if "rotary_emb" in name or (spec is not None and name.endswith(_SKIPPED)):
            continue
        scale_check(name, tensor)
        decoder_name = _decoder_name(name, tensor, encoder, dtype)
        if decoder_name is None:
            continue  # the vision encoder's
        name = decoder_name
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the head shares the embedding table
        if int4_layers is not None and isinstance(tensor, torch.Tensor):
            hit = int4_layouts.split_name(name, int4_layers.spec, tensor.dtype)
            if hit is not None:
                int4_layers.add(*hit, tensor)  # as stored (packed ints, scales); a whole layer installed
                continue
        if isinstance(tensor, GGUFBlocks):
            assert gguf_layers is not None
            loaded.update(gguf_layers.add(name, tensor))
            continue
        if kv_scales.take(name, tensor):
            continue
        name, tensor = checkpoint_scale(name, tensor)
        keep = tensor.dtype in FP8_DTYPES or name.endswith(".weight_scale")  # (their loaders cast, or refuse)
        filled = _place(model, name, tensor if keep else tensor.to(dtype), spec)
        loaded.update(filled)
        rounding.filled(filled)
    if int4_layers is not None and not dummy:
        loaded.update(int4_layers.finish())
    if dummy:
        _random_weights(model, int4_spec is not None, rounding)
        if int4_spec is not None:  # the layers an int4/int8 checkpoint quantizes, random in its form
            int4.install_random(model, int4_spec, dtype, int4_kernel)
    else:
        missing = sorted(expected - loaded) + (encoder.missing_weights() if encoder is not None else [])
        _check_complete(model, path, missing)
    model.kv_cache_scales = kv_scales.scales(cfg.num_layers)
    model.kv_cache_format = declared.checkpoint_kv_cache(path, device)
    model.requires_grad_(False).eval()
    if scheme is not None:
        assert spec is not None
        scheme.finish(model, spec, quantized, rounding.done)
    # (the float layers beside quantized GGUF or int4 ones keep torch's GEMM)
    if not (gguf_layers is not None and gguf_layers.finish()) and int4_spec is None:
        pack_cpu_gemms(model)
    _check_materialized(model)
    log.info("%s", weights_summary(model))
    model.vision = encoder  # (after the decoder's GEMMs are packed: the encoder keeps torch's)
    _drop_loaders(model)
    return model


def _drop_loaders(model: torch.nn.Module) -> None:
    """Remove each parameter's `weight_loader` once loading is over: a layer's bound `load_shard` on its
    own parameter is a reference cycle, which would keep the weights alive after the engine lets go of
    the model until the garbage collector runs (leaving `with LLM(...)` frees them at once)."""
    for param in model.parameters():
        param.__dict__.pop("weight_loader", None)


def _decoder_name(name: str, tensor: object, encoder: VisionEncoder | None, dtype: torch.dtype) -> str | None:
    """The decoder's name of a checkpoint tensor, or None where the vision encoder took it (a
    vision-language checkpoint: its encoder's weights, the decoder's renamed)."""
    if encoder is not None:
        if isinstance(tensor, torch.Tensor) and encoder.load_weight(name, _as_float(tensor, dtype)):
            return None
        name = text_weight_name(name)
    if name.split(".", 1)[0] in _BODY_PARTS:  # a bare decoder's (an embedding model saved without its
        name = f"model.{name}"  # head, e.g. Qwen3-Embedding): the body's names, unprefixed
    return name


def _as_float(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float tensor in `dtype`; any other as it is (an integer one is a quantized weight, which the
    vision encoder refuses by name rather than read as a cast of its codes)."""
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _check_complete(model: CausalLM, path: Path, missing: list[str]) -> None:
    """Refuse a checkpoint that lacks weights the model or its vision encoder has (`missing`); a
    sentence-transformers embedding model may lack its head (it pools hidden states, and the one token its
    requests sample, and drop, comes from zeros)."""
    if missing == ["lm_head.weight"] and (path / "modules.json").is_file():
        model.lm_head.weight.data.zero_()
        log.info("%s has no lm_head: loaded for embeddings only", path)
        return
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights: {', '.join(missing[:8])}")


def _check_materialized(model: CausalLM) -> None:
    """Refuse a load that left a deferred weight without its memory (`layers.deferred_weights`): neither
    a float tensor nor a quantized form filled it (a fused layer whose checkpoint quantizes only some
    shards fails in its quantized form's install first)."""
    empty = [name for name, p in model.named_parameters() if is_placeholder(p)]
    if empty:
        raise ValueError(f"weights left unloaded: {', '.join(empty[:8])}")


def _random_weights(model: CausalLM, int4_layers: bool, rounding: _OnlineRounding) -> None:
    """Every parameter random (normal, std 0.02; e4m3 weights alike), norms and scales 1, each layer
    `--quantization fp8` quantizes rounded as its weight is made (`rounding`), as a checkpoint's load
    does; with `int4_layers`, not the weights an int4/int8 checkpoint quantizes (never made)."""
    quantized = {n for n, m in model.named_modules() if int4_layers and int4.quantizes(m)}
    # (a codebook's kept layers, bitsandbytes 4-bit's: random weights it holds, `bnb.representable`)
    representable = getattr(rounding.scheme, "representable", None)
    for name in [n for n, _ in model.named_parameters()]:  # (by name: the rounding replaces parameters,
        p = model.get_parameter(name)  # and a kept reference would hold a rounded layer's float weight)
        if name.rsplit(".", 1)[0] in quantized and is_placeholder(p):
            continue
        materialize(p)
        if "norm" in name or name.endswith("weight_scale"):
            p.data.fill_(1.0)
        else:
            p.data.copy_(torch.randn(p.shape, device=p.device) * 0.02)
            if representable is not None and name.rsplit(".", 1)[0] in rounding.waiting:
                p.data.copy_(representable(p.data, rounding.spec))
        rounding.filled(weight_names.names_of(model, name))


# a checkpoint's static activation scales (and int8 zero points, fbgemm_fp8's bound): activations are
# scaled per token, or not quantized at all (int-quantized: w8a16; NVFP4: w4a16)
_SKIPPED = (".input_scale", ".input_zero_point", ".input_scale_ub", ".input_global_scale")


def quant_spec(path: str | Path, quantization: str | None, device: torch.device | str) -> QuantSpec | None:
    """The quantized format a load of `path` runs (None: float weights), or a one-line QuantFormatError."""
    path = Path(path)
    if is_gguf_file(path):
        formats.check_gguf_flag(quantization)
        return None
    return formats.resolve(declared.checkpoint_quantization(path), quantization, device)


def check_layers(cfg: ModelConfig, spec: QuantSpec, tp_size: int, path: Path) -> None:
    """Refuse, before any process loads it, a format quantized at load (`spec.online`) or an fp8
    checkpoint's blocks (under tensor parallelism) that cannot take the model's layers as `tp_size` ranks
    cut them (e.g. a layer's inputs in no whole blocks): the format's own checks (`quantized_modules`, or
    `prepare` on the checkpoint's layers) on the model built with no memory (`meta`), as rank 0 builds it."""
    scheme = importlib.import_module(f"gapless.model.quant.{spec.scheme}")
    previous = parallel.current()
    parallel.use(parallel.TPGroup(rank=0, size=tp_size))
    try:
        with torch.device("meta"), deferred_weights():
            model = CausalLM(cfg)
        if spec.online:
            scheme.quantized_modules(model, spec, set())
        else:
            _prepare_quantized(model, spec, path, False, torch.device("meta"))
    finally:
        parallel.use(previous)


def _prepare_quantized(
    model: CausalLM, spec: QuantSpec | None, path: Path, dummy: bool, device: torch.device
) -> tuple[Any, list[str]]:
    """(the format's module, the modules it quantizes), their parameters made ready for its tensors (a
    `dummy` load: the modules such checkpoints quantize, `usual_targets`)."""
    if spec is None or spec.scheme == "int4":  # int4's layers take their method after loading
        return None, []
    if spec.scheme == "bnb" and not (spec.online or bnb.kept(device)):  # (read as floats, and left so)
        return None, []
    scheme = importlib.import_module(f"gapless.model.quant.{spec.scheme}")
    targets: set[str] = set(scheme.usual_targets(model)) if dummy else set()
    if not spec.online and not dummy:
        for file in safetensors_files(path):
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
            for name in names:
                for suffix in scheme.SCALE_NAMES:
                    if name.endswith(f".{suffix}"):
                        param = weight_names.target(f"{name[: -len(suffix)]}weight")[0]
                        targets.add(param.rsplit(".", 1)[0])
    quantized = scheme.quantized_modules(model, spec, targets)
    scheme.prepare(model, spec, quantized)
    return scheme, quantized


def _int4_kernel(
    model: CausalLM, spec: int4_layouts.Int4Spec, dtype: torch.dtype, device: torch.device
) -> str:
    """Which int4 GEMMs the model's layers run: GAPLESS_INT4_KERNEL, with `auto`'s second copies if the
    GPU has room for them (`int4_kernels.for_model`, weighed on the float layers before they are packed)."""
    if spec.codebook:  # (a codebook's layers run the Triton GEMM alone: no second copy)
        return "triton"
    numel = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, _Linear) and int4.is_quantized_linear(m)
    )
    return int4_kernels.for_model(numel, spec.bits, dtype, device)


def _gguf_layers(
    model: CausalLM, path: Path, kept: str, dtype: torch.dtype
) -> GGUFLayers | _CpuGGUFLayers | None:
    """What takes a GGUF load's quantized matrices as `gguf_kept` says (`add` each, `finish` after the
    last): the int4/int8 path's layers, installed as each module is whole ("int4"), or the CPU's ("cpu");
    None where none come as blocks."""
    if kept == "int4":
        return gguf_int4.GGUFLayers(model, gguf.quantized_types(path), dtype)
    return _CpuGGUFLayers(model, dtype) if kept == "cpu" else None


class _CpuGGUFLayers(gguf_int4.GGUFModules):
    """A one-rank CPU's GGUF layers (`gguf_cpu`), each module given its quantized form as soon as it is
    whole (`GGUFModules`), its float weight never made (a mixture's experts the int4/int8 path's,
    `gguf_int4.install_experts`). An embedding table is read from the file where it lies
    (`gguf_cpu.FileRows`); a tied LM head holds the table in its own layout."""

    def __init__(self, model: CausalLM, dtype: torch.dtype) -> None:
        super().__init__(model)
        self.dtype = dtype

    def _install(self, name: str, shards: dict[Any, GGUFBlocks]) -> None:
        module = self.model.get_submodule(name)
        if isinstance(module, Experts):
            gguf_int4.install_experts(module, shards, self.dtype, name)
            return
        order = [None] if None in shards else list(getattr(module, "shard_offsets", None) or [None])
        parts = [shards[s] for s in order]  # (a projection the file stores fused: whole, its rows in order)
        if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
            if len(parts) != 1:
                raise ValueError(f"{name}: an embedding table of {len(parts)} GGUF matrices")
            module.quantized_rows = gguf_cpu.FileRows(parts[0])
            head = self.model.lm_head
            if head.weight is module.weight:  # tied: the head holds the table in its own layout
                head.linear_method = gguf_cpu.linear_method(parts, None, gguf_cpu.int4_for("lm_head"))
        elif isinstance(module, (_Linear, ParallelLMHead)):
            int4 = gguf_cpu.int4_for(name)
            module.linear_method = gguf_cpu.linear_method(parts, getattr(module, "bias", None), int4)
        else:
            raise ValueError(f"{name} ({type(module).__name__}) has no quantized form")
        module.weight.data = module.weight.data.new_empty(0)


# the last parts of the names quantized checkpoints give their tensors (AWQ, GPTQ, compressed-tensors, FP8)
_QUANTIZED_TENSORS = {
    *int4_layouts.TENSORS["gptq"],
    *int4_layouts.TENSORS["compressed-tensors"],
    *SCALE_NAMES,
    *(t for t in int4_layouts.TENSORS["bitsandbytes"] if t != "weight"),  # (8-bit's SCB, weight_format)
    *bnb.PARTS,  # (4-bit's)
}


def _place(model: CausalLM, name: str, tensor: torch.Tensor, spec: QuantSpec | None = None) -> list[str]:
    """Load one checkpoint tensor into its parameter; the names it filled (`name#shard` for a fused one);
    `spec`: the format the checkpoint declares, which a refusal names.

    A separate q/k/v or gate/up tensor goes into its shard of the fused parameter; a tensor the checkpoint
    already fuses (Phi-3's `qkv_proj`, `gate_up_proj`) is split along its rows into every shard."""
    name, shard = weight_names.target(name)
    try:  # (looked up each time, not kept: an online load's rounding replaces a layer's parameters,
        param = model.get_parameter(name)  # and a kept reference would hold its float weight)
    except AttributeError:
        hint = ""
        quantized = name.rpartition(".")[2] in _QUANTIZED_TENSORS
        if quantized and spec is not None:
            hint = f" (a quantized checkpoint's tensor, which its declared {spec.label} does not hold)"
        elif quantized:
            hint = (
                " (a quantized checkpoint's tensor, but the checkpoint declares no quantization: "
                f"{formats.DECLARED_IN})"
            )
        raise ValueError(
            f"checkpoint weight {name!r} has no place in the {model.cfg.architecture} model{hint}"
        ) from None
    check_fp8_dtype(name, tensor.dtype, param.dtype)
    materialize(param)  # (a deferred weight: its memory, as a float tensor fills it)
    loader = getattr(param, "weight_loader", default_weight_loader)
    # where each shard sits in the checkpoint's fused tensor (whole, whatever this rank keeps of it)
    offsets = getattr(weight_names.owner(model, name), "checkpoint_offsets", None)
    if shard is None and offsets:
        if tensor.shape[0] != sum(n for _, n in offsets.values()):
            whole = sum(n for _, n in offsets.values())
            raise ValueError(f"fused weight {name!r} has {tensor.shape[0]} rows, the model {whole}")
        for shard_id, (off, n) in offsets.items():
            loader(param, tensor.narrow(0, off, n), shard_id)
        return [f"{name}#{s}" for s in offsets]
    loader(param, tensor, shard)
    return [name if shard is None else f"{name}#{shard}"]


class _OnlineRounding:
    """A float checkpoint quantized at load (`--quantization fp8`, `bitsandbytes`, `rtn`, `experts_int8`),
    and a bitsandbytes 4-bit checkpoint kept in 4 bits (`modules`: none for any other load): each layer it
    quantizes is rounded as the last of its float weight's tensors loads (the scheme's `finish_module`), so
    the load holds the float weights of the layers whose tensors are still arriving (one, for a checkpoint
    stored layer by layer), not the float model's."""

    def __init__(self, model: CausalLM, scheme: Any, spec: QuantSpec | None, modules: list[str]) -> None:
        self.model, self.scheme, self.spec = model, scheme, spec
        self.waiting: dict[str, set[str]] = {}  # module -> the names still to fill its weights
        for module in modules:
            self.waiting[module] = weight_names.weights_of(model, module)
        self.done: set[str] = set()

    def filled(self, names: list[str]) -> None:
        """`_place` filled `names`: round each layer whose weights are now whole."""
        for name in names:
            module = name.partition("#")[0].rsplit(".", 1)[0]
            waiting = self.waiting.get(module)
            if waiting is None or name not in waiting:
                continue
            waiting.discard(name)
            if not waiting:
                del self.waiting[module]
                self.scheme.finish_module(self.model.get_submodule(module), self.spec)
                self.done.add(module)

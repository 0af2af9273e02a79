"""bitsandbytes checkpoints (`quant_method: bitsandbytes`): 4-bit (NF4, FP4, double-quantized or not)
read as float weights, kept in 4 bits on bitsandbytes' CPU kernel where it runs and on the int4 path's
Triton GEMM with the codebook (a GPU's; here its reference path and the interpreter); 8-bit kept int8 on
the w8a16 path. Each against transformers on the same
dequantized weights (checkpoints the tests write: `gapless.testing.bnb_checkpoints`), and, where
bitsandbytes is installed, against transformers reading checkpoints through bitsandbytes: the tests'
files, and files bitsandbytes itself wrote."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gapless import LLM, SamplingParams
from gapless.model import loader
from gapless.model.quant import bnb, int4, quantization, weights_held
from gapless.model.quant.base import UNQUANTIZED
from gapless.model.quant.formats import QuantFormatError, resolve
from gapless.testing.bnb_checkpoints import quantization_config, write_bnb
from gapless.testing.hf_reference import check_greedy, hf_greedy, hf_logits, load_hf_model, make_prompts
from gapless.testing.quant_checkpoints import (
    assert_codebook_layers,
    assert_refused_after,
    edit_tensors,
    experts_of,
    linear_layers,
)
from gapless.testing.ranks import assert_experts_cut, load_as_ranks

MAX_NEW = 8
CPU = torch.device("cpu")
BNB_ABSENT = importlib.util.find_spec("bitsandbytes") is None
NEEDS_BNB = pytest.mark.skipif(
    BNB_ABSENT, reason="bitsandbytes is absent: transformers reads and writes its checkpoints through it"
)


def _greedy(model: Path, prompts: list[list[int]], device: str = "cpu") -> list[list[int]]:
    with LLM(str(model), device=device, dtype="float32", kv_cache_tokens=2048, overlap=False) as llm:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
    return [o.token_ids for o in outs]


def _agrees(qdir: Path, reference: torch.nn.Module, device: str = "cpu") -> None:
    """Greedy tokens (on `device`) equal the reference's, or diverge at a near-tie once at most."""
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    ours = _greedy(qdir, prompts, device)
    notes = [check_greedy(o, hf_greedy(reference, p, MAX_NEW)) for o, p in zip(ours, prompts)]
    assert sum(n is not None for n in notes) <= 1, notes


@pytest.mark.parametrize(
    "arch,kind,nested",
    [
        ("llama", "nf4", True),  # unsloth's `*-bnb-4bit`: NF4, double-quantized
        ("qwen3", "fp4", False),
        ("phi3", "nf4", False),  # q/k/v and gate/up fused in the checkpoint
        ("qwen2", "int8", False),  # q/k/v bias, tied head
        ("phi3", "int8", False),
    ],
)
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(
    ckpt_factory, tmp_path, int4_reference_path, monkeypatch, arch, kind, nested
):
    monkeypatch.setenv("GAPLESS_BNB_WEIGHTS", "dequantize")  # (4-bit: read as floats and left so)
    qdir, refdir = write_bnb(ckpt_factory(arch), tmp_path, kind, nested)
    model = loader.load_model(qdir, torch.float32, CPU)
    ref_model = loader.load_model(refdir, torch.float32, CPU)
    formats, held = weights_held(model)
    if kind == "int8":  # kept int8: fewer bytes than the float reference's
        assert formats.get("bitsandbytes w8a16 channel"), formats
        assert quantization(model) == "bitsandbytes"
        assert held < weights_held(ref_model)[1]
    else:  # read as floats: the reference's weights, bit for bit
        assert quantization(model) is None and formats == weights_held(ref_model)[0]
        ours, theirs = dict(model.named_parameters()), dict(ref_model.named_parameters())
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    _agrees(qdir, load_hf_model(refdir))


FUSED_ABSENT = BNB_ABSENT or not bnb._fused_cpu_kernel()
NEEDS_FUSED = pytest.mark.skipif(
    FUSED_ABSENT,
    reason="bitsandbytes' fused 4-bit CPU kernel (bitsandbytes installed, a CPU with AVX512-BF16) is absent: "
    "4-bit weights stay float here (test_greedy_tokens_equal_transformers_on_the_dequantized_weights)",
)


@NEEDS_FUSED
@pytest.mark.parametrize(
    "arch,kind,nested", [("llama", "nf4", True), ("qwen3", "fp4", False), ("phi3", "nf4", False)]
)
def test_4bit_kept_on_the_cpu_gives_bitsandbytes_own_tokens(ckpt_factory, tmp_path, arch, kind, nested):
    """Under `auto` a one-rank CPU keeps every 4-bit layer in 4 bits on bitsandbytes' own kernel, from
    the codes and scales its weights were dequantized from: fewer bytes than the float model's, and the
    tokens of transformers running the checkpoint through bitsandbytes (the same kernel, x in bfloat16)."""
    qdir, refdir = write_bnb(ckpt_factory(arch), tmp_path, kind, nested)
    model = loader.load_model(qdir, torch.float32, CPU)
    formats, held = weights_held(model)
    linear = linear_layers(model)
    assert all(isinstance(m.linear_method, bnb.Bnb4LinearMethod) for m in linear), formats
    assert formats[f"bitsandbytes {kind} b64 (bitsandbytes' CPU kernel)"] == len(linear)
    assert quantization(model) == "bitsandbytes"
    assert held < weights_held(loader.load_model(refdir, torch.float32, CPU))[1]
    _agrees(qdir, load_hf_model(qdir))


@NEEDS_FUSED
@pytest.mark.parametrize("nested", [True, False])
def test_a_bfloat16_model_keeps_every_4bit_layer(ckpt_factory, tmp_path, nested):
    """In bfloat16 the weights read are the codes times their scales rounded: quantizing them again gives
    back the same codes (to within that rounding), so every layer is kept."""
    qdir, _ = write_bnb(ckpt_factory("llama"), tmp_path, "nf4", nested)
    model = loader.load_model(qdir, torch.bfloat16, CPU)
    linear = linear_layers(model)
    assert all(isinstance(m.linear_method, bnb.Bnb4LinearMethod) for m in linear)


@NEEDS_FUSED
def test_a_layer_the_checkpoint_keeps_float_stays_float(ckpt_factory, tmp_path):
    """A layer whose float weight no block size gives back (bitsandbytes' `llm_int8_skip_modules`) is not
    quantized at load: it stays float beside the kept ones."""
    qdir, refdir = write_bnb(ckpt_factory("llama"), tmp_path, "nf4")
    reference = load_file(str(refdir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"

    def keep_float(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.startswith(name)]:
            del tensors[key]
        tensors[name] = reference[name] + 1e-3 * torch.randn_like(reference[name])

    edit_tensors(qdir, keep_float)
    model = loader.load_model(qdir, torch.float32, CPU)
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    assert down.linear_method is UNQUANTIZED  # (its float weight, prepacked for the CPU's GEMM)
    assert isinstance(model.get_submodule("model.layers.1.mlp.down_proj").linear_method, bnb.Bnb4LinearMethod)


@pytest.mark.parametrize(
    "arch,kind,nested", [("llama", "nf4", True), ("qwen3", "fp4", False), ("phi3", "nf4", False)]
)
def test_4bit_kept_for_the_triton_gemm_holds_the_checkpoints_weights(
    ckpt_factory, tmp_path, monkeypatch, arch, kind, nested
):
    """Where the Triton GEMM keeps 4-bit weights (a GPU's route; here, on the CPU, the layers' float weights
    made once from them), every linear layer holds the checkpoint's codes and scales with the codebook: its
    weight the reference's bit for bit (fused projections stacked), a GPU's bytes under a seventh of the
    float32 weights', and transformers' tokens on the reference."""
    monkeypatch.setattr(bnb, "kept", lambda device: "triton")
    monkeypatch.setenv("GAPLESS_CPU_GEMM", "plain")  # (the reference's float weights left as loaded)
    qdir, refdir = write_bnb(ckpt_factory(arch), tmp_path, kind, nested)
    model = loader.load_model(qdir, torch.float32, CPU)
    ref_model = loader.load_model(refdir, torch.float32, CPU)
    methods = assert_codebook_layers(model, ref_model, f"bitsandbytes {kind} g64")
    assert quantization(model) == "bitsandbytes"
    # (here, on the CPU, which no kernel of a codebook runs on: their float weights beside, made once)
    assert all(torch.equal(m.float_weight, m.dequantized(torch.float32)) for m in methods)
    _agrees(qdir, load_hf_model(refdir))


@pytest.mark.parametrize("kind,nested", [("nf4", True), ("fp4", False)])
def test_4bit_experts_kept_for_the_triton_gemm_hold_the_checkpoints_weights(
    ckpt_factory, tmp_path, monkeypatch, kind, nested
):
    """A mixture whose checkpoint quantizes each expert's projections (one `nn.Linear` an expert, as
    transformers 4 wrote them: unsloth's MoE `*-bnb-4bit`): on the Triton route every layer's experts are
    held as the checkpoint's codes for the grouped GEMM, each expert's weight the reference's bit for bit,
    in 4 bits; transformers' tokens on the reference."""
    monkeypatch.setattr(bnb, "kept", lambda device: "triton")
    monkeypatch.setenv("GAPLESS_CPU_GEMM", "plain")
    qdir, refdir = write_bnb(ckpt_factory("qwen3_moe", moe_intermediate_size=64), tmp_path, kind, nested)
    model = loader.load_model(qdir, torch.float32, CPU)
    ref = loader.load_model(refdir, torch.float32, CPU)
    for ours, theirs in zip(experts_of(model), experts_of(ref), strict=True):
        assert ours.weight_format == f"bitsandbytes {kind} g64 experts"
        assert ours.int_quant is not None and ours.cpu_weights is not None
        table = torch.tensor(bnb.TABLES[kind])
        assert all(q.levels is not None and torch.equal(q.levels, table) for q in ours.int_quant)
        assert (
            ours.gate_up_proj.dtype == torch.int32
            and ours.gate_up_proj.numel() * 8 == theirs.gate_up_proj.numel()
        )
        assert torch.equal(ours.cpu_weights[0], theirs.gate_up_proj) and torch.equal(
            ours.cpu_weights[1], theirs.down_proj
        )
    _agrees(qdir, load_hf_model(refdir))


def test_4bit_experts_on_two_ranks_hold_each_ranks_piece(ckpt_factory, tmp_path, monkeypatch):
    """Each tensor-parallel rank quantizes its own piece of the experts again (gate/up rows, down columns
    in whole blocks): the whole layer's weights cut; where a rank's down columns would split the
    checkpoint's blocks (32 of a block of 64), its experts stay float."""
    monkeypatch.setattr(bnb, "kept", lambda device: "triton")
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", "triton")
    src = ckpt_factory("qwen3_moe", moe_intermediate_size=128)
    qdir, _ = write_bnb(src, tmp_path, "nf4")
    whole, ranks = load_as_ranks(qdir)
    for experts, *pieces in zip(experts_of(whole), *map(experts_of, ranks), strict=True):
        assert all(p.weight_format == "bitsandbytes nf4 g64 experts" for p in [experts, *pieces])
        assert_experts_cut(experts, pieces)
    qdir, _ = write_bnb(ckpt_factory("qwen3_moe", moe_intermediate_size=64), tmp_path / "split", "nf4")
    _, ranks = load_as_ranks(qdir)
    assert all(e.int_quant is None and e.weight_format is None for r in ranks for e in experts_of(r))


def test_4bit_on_the_triton_gemm_gives_transformers_tokens(ckpt_factory, tmp_path, monkeypatch):
    """The Triton GEMM itself over the codebook's weights (on CUDA where there is one, else under the
    interpreter: `int4.TRITON_ON_CPU`, which `kept` takes as a GPU's route): transformers' greedy tokens on
    the reference; in bfloat16 every layer is kept too (its weights within their rounding)."""
    from gapless.model.quant import int4_triton

    gemm, calls = int4_triton.w4a16_matmul, []
    monkeypatch.setattr(
        int4_triton, "w4a16_matmul", lambda *a, **k: calls.append(k["levels"] is not None) or gemm(*a, **k)
    )
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(int4, "TRITON_ON_CPU", device.type == "cpu")
    qdir, refdir = write_bnb(ckpt_factory("llama"), tmp_path, "nf4", nested=True)
    model = loader.load_model(qdir, torch.bfloat16, device)
    nf4 = torch.tensor(bnb.NF4, dtype=torch.float32)  # (the levels in float32 whatever the model's dtype)
    assert all(torch.equal(m.linear_method.levels.cpu(), nf4) for m in linear_layers(model))
    _agrees(qdir, load_hf_model(refdir), device.type)
    assert len(calls) >= 8 * 4 and all(calls)  # (forwards x projections, each with the codebook)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_a_dummy_load_keeps_random_4bit_layers_and_generates(ckpt_factory, tmp_path, monkeypatch, arch):
    """`--load-format dummy` of an NF4 checkpoint's config (`gapless.bench.quant`'s `-nf4` shapes): random
    weights NF4 holds (`bnb.representable`), which every linear layer (and a mixture's experts) then keeps
    as a checkpoint's; the engine generates."""
    monkeypatch.setattr(bnb, "kept", lambda device: "triton")
    shape = {"moe_intermediate_size": 64} if arch == "qwen3_moe" else {}
    qdir, _ = write_bnb(ckpt_factory(arch, **shape), tmp_path, "nf4", nested=True)
    for file in qdir.glob("*.safetensors"):
        file.unlink()
    model = loader.load_model(qdir, torch.bfloat16, CPU, dummy=True)
    linear = linear_layers(model)
    assert all(getattr(m.linear_method, "levels", None) is not None for m in linear)
    assert all(0.01 < float(m.linear_method.dequantized(torch.float32).std()) < 0.03 for m in linear)
    assert all(e.weight_format == "bitsandbytes nf4 g64 experts" for e in experts_of(model))
    assert len(experts_of(model)) == (1 if arch == "qwen3_moe" else 0)
    with LLM(str(qdir), device="cpu", dtype="bfloat16", load_format="dummy", kv_cache_tokens=256) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_what_keeps_4bit_weights_on_each_device(monkeypatch):
    """`kept`: the Triton GEMM on CUDA (any number of ranks) and where the tests run it on the CPU;
    bitsandbytes' kernel on a one-rank CPU where it runs; none under `dequantize` or on CPU ranks."""
    from gapless.model import parallel

    cpu_kernel = None if FUSED_ABSENT else "bitsandbytes"
    assert (bnb.kept(torch.device("cuda")), bnb.kept(CPU)) == ("triton", cpu_kernel)
    parallel.use(parallel.TPGroup(rank=0, size=2))
    try:
        assert (bnb.kept(torch.device("cuda")), bnb.kept(CPU)) == ("triton", None)
    finally:
        parallel.use(parallel.SINGLE)
    monkeypatch.setattr(int4, "TRITON_ON_CPU", True)
    assert bnb.kept(CPU) == "triton"
    monkeypatch.setenv("GAPLESS_BNB_WEIGHTS", "dequantize")
    assert bnb.kept(torch.device("cuda")) is None and bnb.kept(CPU) is None


def test_codes_give_back_only_a_weight_of_their_codebook_and_blocks():
    """`bnb.codes` finds a block-quantized weight's codes and scales in its own blocks (128 here) and
    codebook, and none in blocks that split the checkpoint's, another codebook, or a float weight."""
    table = torch.tensor(bnb.NF4)
    q = torch.randint(1, 15, (8, 256))  # (NF4: code 0 is -1.0, code 15 is 1.0)
    q[:, ::128] = 15  # (each block of 128 holds its scale times 1.0 once: not each block of 64)
    scale = torch.rand(8, 2) + 0.1
    w = table[q] * scale.repeat_interleave(128, dim=1)
    found = bnb.codes(w, "nf4", 128)
    assert found is not None and torch.equal(found[0].long(), q) and torch.equal(found[1], scale)
    assert bnb.codes(w, "nf4", 64) is None and bnb.codes(w, "fp4", 128) is None
    assert bnb.codes(torch.randn(8, 256), "nf4", 64) is None


def test_int8_on_the_cpus_kernel(ckpt_factory, tmp_path):
    """Under `auto` the CPU runs the 8-bit rows on torch's int8 kernel (x rounded to bfloat16)."""
    qdir, refdir = write_bnb(ckpt_factory("llama"), tmp_path, "int8")
    formats, _ = weights_held(loader.load_model(qdir, torch.float32, CPU))
    assert any(f.startswith("bitsandbytes w8a16 channel (torch-cpu") for f in formats), formats
    _agrees(qdir, load_hf_model(refdir))


@pytest.mark.parametrize(
    "qcfg,words",
    [
        ({"quant_method": "bitsandbytes"}, ("neither load_in_4bit nor load_in_8bit",)),
        (quantization_config("nf4"), ("bitsandbytes nf4",)),
        ({**quantization_config("nf4"), "bnb_4bit_quant_type": "int4"}, ("bnb_4bit_quant_type 'int4'",)),
        (quantization_config("int8"), ("bitsandbytes w8a16 channel",)),
    ],
)
def test_the_config_names_the_format(qcfg, words):
    try:
        label = resolve(qcfg, None, "cpu").label
    except QuantFormatError as e:
        label = str(e)
    assert all(w in label for w in words), label


def _state_name(tensors: dict[str, torch.Tensor]) -> str:
    return next(n for n in tensors if ".quant_state." in n)


def _state_with(tensors: dict[str, torch.Tensor], **changes: object) -> None:
    """The first layer's quant_state JSON with `changes` made."""
    name = _state_name(tensors)
    state = {**json.loads(bytes(tensors[name].tolist())), **changes}
    tensors[name] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)


@pytest.mark.parametrize(
    "kind,edit,words",
    [
        ("nf4", lambda t: t.pop(_state_name(t).split(".quant_state")[0] + ".absmax"), ("lacks its absmax",)),
        ("nf4", lambda t: _state_with(t, blocksize=0), ("a quant_state blocksize of 0",)),
        ("nf4", lambda t: t.pop(_state_name(t)), ("down_proj.weight", "lacks its quant_state")),
        (
            "nf4",
            lambda t: t.__setitem__(
                _state_name(t),
                torch.tensor(list(json.dumps({"quant_type": "int4"}).encode()), dtype=torch.uint8),
            ),
            ("quant_type 'int4' is not read",),
        ),
        (
            "int8",
            lambda t: t.__setitem__(
                next(n for n in t if n.endswith("weight_format")), torch.tensor(2, dtype=torch.uint8)
            ),
            ("weight_format 2 is not read",),
        ),
    ],
)
def test_a_broken_checkpoint_is_refused_by_name(ckpt_factory, tmp_path, kind, edit, words):
    assert_refused_after(write_bnb(ckpt_factory("llama"), tmp_path, kind)[0], edit, words)


def _compute_in_float32(qdir: Path) -> None:
    """The checkpoint's 4-bit layers computed in float32 by bitsandbytes (the tests' models are float32)."""
    file = qdir / "config.json"
    config = json.loads(file.read_text())
    config["quantization_config"]["bnb_4bit_compute_dtype"] = "float32"
    file.write_text(json.dumps(config))


def _float_path(model: torch.nn.Module) -> torch.nn.Module:
    """A transformers model's bitsandbytes 4-bit layers on their float path: on a CPU with AVX512-BF16,
    bitsandbytes otherwise runs its fused kernel at inference, x and the scales rounded to bfloat16."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model.eval()


@NEEDS_BNB
@pytest.mark.parametrize("kind,nested", [("nf4", True), ("fp4", False)])
def test_transformers_reads_the_tiny_4bit_checkpoint(ckpt_factory, tmp_path, kind, nested):
    """transformers' own reading of the tests' file (through bitsandbytes) gives the reference's logits: the
    layout as the tests write it is the one bitsandbytes reads."""
    qdir, refdir = write_bnb(ckpt_factory("llama"), tmp_path, kind, nested)
    _compute_in_float32(qdir)
    ids = make_prompts(1000, n=1, max_len=20, shared_prefix=4)[0]
    theirs = hf_logits(_float_path(load_hf_model(qdir)), ids)
    torch.testing.assert_close(theirs.float(), hf_logits(load_hf_model(refdir), ids), rtol=1e-5, atol=1e-5)


@NEEDS_BNB
def test_transformers_reads_the_tiny_8bit_checkpoint(ckpt_factory, tmp_path):
    """bitsandbytes' reading of the tests' 8-bit file holds the reference's weights (its layers then round
    x to int8 too, LLM.int8, so their logits are not the yardstick)."""
    from bitsandbytes.functional import int8_vectorwise_dequant

    qdir, refdir = write_bnb(ckpt_factory("llama"), tmp_path, "int8")
    theirs, ref = load_hf_model(qdir), load_hf_model(refdir)
    for layer, ref_layer in zip(theirs.model.layers, ref.model.layers):
        for a, b in (
            (layer.self_attn.q_proj, ref_layer.self_attn.q_proj),
            (layer.mlp.down_proj, ref_layer.mlp.down_proj),
        ):
            w = int8_vectorwise_dequant(a.weight.CB, a.weight.SCB)
            torch.testing.assert_close(w.float(), b.weight.float(), rtol=1e-6, atol=1e-7)


@NEEDS_BNB
@pytest.mark.parametrize(
    "kind,weights", [("nf4", "auto"), ("nf4", "dequantize"), ("fp4", "auto"), ("int8", "auto")]
)
def test_a_checkpoint_bitsandbytes_wrote_gives_its_tokens(
    ckpt_factory, tmp_path, int4_reference_path, monkeypatch, kind, weights
):
    """A checkpoint quantized and saved by transformers through bitsandbytes (its NF4/FP4, double
    quantization, its nested code map; its int8 rows), against transformers running it: through
    bitsandbytes at 4 bits (its fused CPU kernel where gapless keeps the weights in 4 bits, else its float
    path); at 8 bits on its weights dequantized (`CB * SCB / 127`) in a float model, as
    bitsandbytes' own layers round x to int8 too."""
    from bitsandbytes.functional import int8_vectorwise_dequant
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    four = kind != "int8"
    config = (
        BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=kind,
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
        if four
        else BitsAndBytesConfig(load_in_8bit=True)
    )
    src = ckpt_factory("llama")
    theirs = AutoModelForCausalLM.from_pretrained(str(src), quantization_config=config, device_map="cpu")
    qdir = tmp_path / f"bnb-{kind}"
    theirs.save_pretrained(str(qdir))
    for file in src.iterdir():  # (the tokenizer's files)
        if not (qdir / file.name).exists():
            shutil.copy(file, qdir / file.name)
    written = json.loads((qdir / "config.json").read_text())["quantization_config"]
    assert (written["quant_method"], written["load_in_4bit"]) == ("bitsandbytes", four)
    if four:  # kept in 4 bits: their fused kernel's tokens (x in bfloat16); else their float path's
        monkeypatch.setenv("GAPLESS_BNB_WEIGHTS", weights)
        _agrees(qdir, theirs.eval() if bnb.kept(CPU) else _float_path(theirs))
        return
    reference = load_hf_model(src)
    quantized = {n: m for n, m in theirs.named_modules() if hasattr(getattr(m, "weight", None), "SCB")}
    assert quantized
    for name, module in quantized.items():
        w = int8_vectorwise_dequant(module.weight.CB, module.weight.SCB)
        reference.get_submodule(name).weight.data.copy_(w)
    _agrees(qdir, reference)


def test_vllms_load_format_bitsandbytes_reads_a_bitsandbytes_checkpoint(ckpt_factory, tmp_path):
    """`--load-format bitsandbytes` (vLLM's older spelling, with `--quantization bitsandbytes`) is `auto`
    for a bitsandbytes checkpoint; any other checkpoint is refused in one line before anything loads."""
    from gapless.config import EngineConfig
    from gapless.engine.preflight import check_engine_config

    src = ckpt_factory("llama")
    qdir, _ = write_bnb(src, tmp_path, "nf4")
    cfg = EngineConfig(model=str(qdir), device="cpu", load_format="bitsandbytes", quantization="bitsandbytes")
    assert check_engine_config(cfg).cfg.load_format == "bitsandbytes"
    with pytest.raises(ValueError) as e:
        check_engine_config(EngineConfig(model=str(src), device="cpu", load_format="bitsandbytes"))
    assert "\n" not in str(e.value) and "is no bitsandbytes checkpoint (quant_method None)" in str(e.value)


def test_a_quantized_vision_tower_is_refused_by_name(tmp_path):
    """An 8-bit vision tower (bitsandbytes quantizes every linear layer it is not told to skip) is refused
    naming the weight, not read as its int8 codes cast to floats."""
    from gapless.testing.qwen_vl_checkpoints import make_qwen_vl_checkpoint

    qdir = make_qwen_vl_checkpoint(tmp_path / "vl")
    name = "visual.blocks.0.attn.qkv.weight"

    def quantize_one(tensors: dict[str, torch.Tensor]) -> None:
        key = next(n for n in tensors if n.endswith(name))
        tensors[key] = torch.ones_like(tensors[key], dtype=torch.int8)

    edit_tensors(qdir, quantize_one)
    with pytest.raises(ValueError) as e:
        loader.load_model(qdir, torch.float32, CPU)
    assert "\n" not in str(e.value) and "is int8: the vision encoder's weights load as floats" in str(e.value)


def test_codes_stored_in_another_dtype_read_the_same(ckpt_factory, tmp_path):
    """`bnb_4bit_quant_storage: bfloat16` (QLoRA under FSDP) stores the same bytes as bfloat16 pairs."""
    qdir, refdir = write_bnb(ckpt_factory("llama"), tmp_path, "nf4")

    def as_bfloat16(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n, t in tensors.items() if n.endswith(".weight") and t.dtype == torch.uint8]:
            tensors[name] = tensors[name].reshape(-1, 2).view(torch.bfloat16)  # [N * K / 4, 1]

    edit_tensors(qdir, as_bfloat16)
    ours = dict(loader.load_model(qdir, torch.float32, CPU).named_parameters())
    theirs = dict(loader.load_model(refdir, torch.float32, CPU).named_parameters())
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)

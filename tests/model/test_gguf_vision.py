"""A GGUF model with its vision projector (llama.cpp's `mmproj` file), as llama.cpp's converter writes a
Gemma 3 vision-language checkpoint: the text model's file and the projector's, beside each other or paired
by `--mmproj`. The pair's config is the checkpoint's, its chats' greedy tokens are transformers' on the
checkpoint, and a projector that is not one, or not of a type read, is refused by name."""

from __future__ import annotations

import dataclasses
import shutil
from functools import partial

import gguf as gguf_py
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from gapless import LLM, SamplingParams
from gapless.config import EngineConfig
from gapless.model import gguf_vision
from gapless.model.config import load_model_config
from gapless.model.source import ModelSourceError, load_tokenizer, localize
from gapless.testing.checkpoints import cached_checkpoint
from gapless.testing.gemma3_checkpoint import TOKENS_PER_IMAGE, make_gemma3_checkpoint
from gapless.testing.gguf_files import write_gguf
from gapless.testing.gguf_mmproj import write_mmproj
from gapless.testing.vision_reference import chat, chat_inputs, hf_chat_greedy, image

MAX_TOKENS = 8
IM_A, IM_B = image(40, 70, 0), image(90, 30, 1)
CONVS = [
    chat("Describe", IM_A, "briefly please"),
    chat("First", IM_A, "then", IM_B, "compare them"),
    chat("No image,\njust text"),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The tiny Gemma 3 checkpoint as llama.cpp runs its text model: queries scaled by 1 / sqrt(head_dim),
    every sixth layer global (its converter writes no pattern)."""
    return make_gemma3_checkpoint(
        tmp_path_factory.mktemp("gemma3"), query_pre_attn_scalar=16, num_hidden_layers=6, layer_types=None
    )


@pytest.fixture(scope="module")
def pair(ckpt, tmp_path_factory):
    """The checkpoint as a model file and an F32 projector file in one directory."""
    folder = tmp_path_factory.mktemp("gemma3-gguf")
    write_gguf(ckpt, folder / "gemma3-tiny.F32.gguf", "F32")
    write_mmproj(ckpt, folder / "mmproj-gemma3-tiny-F32.gguf", "F32")
    return folder


def test_the_pairs_config_is_the_checkpoints(ckpt, pair):
    ours, theirs = load_model_config(pair / "gemma3-tiny.F32.gguf"), load_model_config(ckpt)
    unstored = ("rms_norm_eps", "torch_dtype", "vision")  # (the norm's epsilon stored in float32)
    fields = [f.name for f in dataclasses.fields(ours) if f.name not in unstored]
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert ours.vision is not None and theirs.vision is not None
    same = ("family", "image_token_id", "image_size", "tokens_per_image", "bidirectional")
    assert [getattr(ours.vision, f) for f in same] == [getattr(theirs.vision, f) for f in same]
    assert ours.vision.tokens_per_image == TOKENS_PER_IMAGE
    vision = {k: v for k, v in ours.vision.config["vision_config"].items() if k != "layer_norm_eps"}
    assert vision.items() <= theirs.vision.config["vision_config"].items()


def test_the_projectors_tensors_are_the_checkpoints(ckpt, tmp_path):
    """Every tower and projector tensor, from an F16 file (the form GGUF repositories ship): the
    checkpoint's rounded to f16 (the embeddings F32, as written), the norm's weight less the 1 added."""
    path = write_mmproj(ckpt, tmp_path / "mmproj-f16.gguf", "F16")
    checkpoint = {k.removeprefix("model."): v for k, v in load_file(str(ckpt / "model.safetensors")).items()}
    stored = {
        k.removeprefix("vision_tower.").removeprefix("vision_model."): v
        for k, v in checkpoint.items()
        if not k.startswith("language_model.")
    }
    read = {k.removeprefix("vision_tower.vision_model."): v for k, v in gguf_vision.iter_weights(path)}
    assert read.keys() == stored.keys()
    for name, w in read.items():
        want = torch.from_numpy(stored[name])
        if w.ndim > 1 and "embeddings." not in name:
            want = want.half().float()
        torch.testing.assert_close(w, want, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("paired", ["beside", "--mmproj"])
def test_chats_with_images_give_transformers_tokens(ckpt, pair, tmp_path, paired):
    """Greedy tokens of chats with one and two images and without any equal transformers' on the
    checkpoint, the projector found beside the model's file or named by `--mmproj` from elsewhere."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(ckpt)
    hf = Gemma3ForConditionalGeneration.from_pretrained(ckpt).eval()
    reference = hf_chat_greedy(hf, partial(chat_inputs, processor), CONVS, MAX_TOKENS)
    options: dict = {}
    model = pair / "gemma3-tiny.F32.gguf"
    if paired == "--mmproj":
        (tmp_path / "model").mkdir()
        model = shutil.copy(model, tmp_path / "model")
        options["mmproj"] = str(pair / "mmproj-gemma3-tiny-F32.gguf")
    with LLM(str(model), device="cpu", cpu_worker="inline", **options) as llm:
        outs = llm.chat(CONVS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
        assert [o.token_ids for o in outs] == reference
        token = llm.engine.vision.image_token_id
        assert [o.prompt_token_ids.count(token) for o in outs] == [16, 32, 0]
        llm.check_integrity()


def test_a_text_file_alone_or_with_mmproj_none_is_a_text_model(ckpt, pair, tmp_path):
    """Alone, with `--mmproj none`, or beside another model's projector (a shared folder of GGUF files:
    a Qwen3 file as wide as Gemma's projects), a model file is a text model."""
    (tmp_path / "alone").mkdir()
    alone = shutil.copy(pair / "gemma3-tiny.F32.gguf", tmp_path / "alone")
    assert load_model_config(alone).vision is None
    assert load_model_config(pair / "gemma3-tiny.F32.gguf").vision is not None
    shared = tmp_path / "shared"
    shutil.copytree(pair, shared)
    other = write_gguf(cached_checkpoint("qwen3"), shared / "qwen3-tiny.F32.gguf", "F32")
    assert load_model_config(other).hidden_size == load_model_config(alone).hidden_size
    assert load_model_config(other).vision is None
    assert load_model_config(shared / "gemma3-tiny.F32.gguf").vision is not None
    unpaired = localize(EngineConfig(model=str(pair / "gemma3-tiny.F32.gguf"), device="cpu", mmproj="none"))
    assert load_model_config(unpaired.model).vision is None
    with LLM(unpaired.model, device="cpu", cpu_worker="inline") as llm:
        assert llm.engine.vision is None
        assert llm.chat(CONVS[2], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0].token_ids


def test_a_cut_short_file_beside_the_model_is_passed_over_with_a_warning(tmp_path, caplog):
    """A folder of GGUF files where another quant's download was cut short: the model beside it loads,
    and the search for its projector warns of the file it could not read."""
    good = write_gguf(cached_checkpoint("qwen3"), tmp_path / "qwen3-tiny.F32.gguf", "F32")
    data = good.read_bytes()
    (tmp_path / "qwen3-tiny.Q8_0.gguf").write_bytes(data[: len(data) // 3])
    with caplog.at_level("WARNING", logger="gapless.model.gguf_vision"):
        assert load_model_config(good).vision is None
    assert "qwen3-tiny.Q8_0.gguf: not a whole GGUF file" in caplog.text, caplog.text


def test_pairing_errors_are_one_line_each(ckpt, pair, tmp_path):
    model, mmproj = pair / "gemma3-tiny.F32.gguf", pair / "mmproj-gemma3-tiny-F32.gguf"
    with pytest.raises(ModelSourceError, match="is a vision projector .* --mmproj"):
        localize(EngineConfig(model=str(mmproj), device="cpu"))
    with pytest.raises(ModelSourceError, match="not a GGUF vision projector"):
        localize(EngineConfig(model=str(model), device="cpu", mmproj=str(model)))
    assert localize(EngineConfig(model=str(pair), device="cpu")).model == str(model)  # (its folder names it)
    crowded = tmp_path / "crowded"
    shutil.copytree(pair, crowded)
    shutil.copy(mmproj, crowded / "mmproj-other.gguf")
    with pytest.raises(ModelSourceError, match="2 vision projector files .* name one with --mmproj"):
        localize(EngineConfig(model=str(crowded / model.name), device="cpu"))
    named = localize(EngineConfig(model=str(crowded / model.name), device="cpu", mmproj=str(mmproj)))
    assert load_model_config(named.model).vision is not None


def test_a_projector_of_another_type_is_refused_by_name(ckpt, tmp_path):
    write_gguf(ckpt, tmp_path / "model.gguf", "F32")
    path = write_mmproj(ckpt, tmp_path / "mmproj.gguf", "F32")
    reader = gguf_py.GGUFReader(str(path), "r+")  # (the type's string in place: same length)
    field = reader.fields["clip.projector_type"]
    field.parts[field.data[0]][:] = np.frombuffer(b"llama4", dtype=np.uint8).copy()
    del reader
    with pytest.raises(ValueError, match="projector type 'llama4' is not supported .*gemma3"):
        load_model_config(tmp_path / "model.gguf")


def test_the_gguf_tokenizer_loads_as_transformers_builds_it(pair):
    """The tokenizer saved for worker processes tokenizes as transformers' build from the file: saved under
    Gemma's own class, transformers 5 re-made its pipeline and read each newline as another token."""
    from transformers import AutoTokenizer

    model = pair / "gemma3-tiny.F32.gguf"
    saved = load_tokenizer(localize(EngineConfig(model=str(model), device="cpu")))
    built = AutoTokenizer.from_pretrained(str(pair), gguf_file=model.name)
    text = "Hello world!\n\nThis is  a test,\tof spaces.  Über 123"
    assert saved(text).input_ids == built(text).input_ids
    assert saved.chat_template == built.chat_template


@pytest.mark.slow  # (a server process: ~6 s)
def test_served_with_mmproj_the_openai_client_gets_the_offline_text(ckpt, pair, tmp_path):
    """`gapless serve --model FILE --mmproj FILE`, as llama-server takes them: the `openai` client's chat
    with an image as a data URL gets what offline `LLM.chat` gives."""
    import base64
    import io

    import openai

    from gapless.testing.server import ServerProcess

    buf = io.BytesIO()
    IM_A.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    parts = [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": url}}]
    messages = [{"role": "user", "content": parts}]
    (tmp_path / "model").mkdir()
    model = shutil.copy(pair / "gemma3-tiny.F32.gguf", tmp_path / "model")
    mmproj = pair / "mmproj-gemma3-tiny-F32.gguf"
    srv = ServerProcess("--device", "cpu", "--model", str(model), "--mmproj", str(mmproj))
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        served = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=messages, max_tokens=8, temperature=0.0
        )
    finally:
        assert srv.stop() == 0, srv.output
    with LLM(str(model), device="cpu", mmproj=str(mmproj)) as llm:
        offline = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)[0]
    assert served.choices[0].message.content == offline.text and offline.text
    assert served.usage.prompt_tokens == len(offline.prompt_token_ids) > TOKENS_PER_IMAGE

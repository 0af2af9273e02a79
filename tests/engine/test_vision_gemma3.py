"""Gemma 3 vision-language end to end, offline: greedy tokens equal transformers'
`Gemma3ForConditionalGeneration` on a tiny random checkpoint (one and two images, text before, between and
after; a sliding-window layer), whose decoder lets an image's tokens attend to each other both ways. So
the prefill attends over each image both ways too (`AttentionMetadata.q_limits`), in the torch reference
and the Triton extend kernel, and a prefill chunk never ends inside an image (`images.chunk_tokens`);
with page sizes 1 and 16, overlap on and off, and the radix cache keyed by image content (a repeated image
hits, a different image of the same size misses)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.engine.images import PromptImage, chunk_tokens
from gapless.testing.gemma3_checkpoint import TOKENS_PER_IMAGE, make_gemma3_checkpoint
from gapless.testing.vision_reference import (
    chat,
    chat_inputs,
    check_greedy_chats,
    check_prefix_cache_keys_images,
    check_retraction,
    greedy_cases,
    hf_chat_greedy,
    image,
    image_count,
)

MAX_TOKENS = 8


IM_A, IM_B, IM_C = image(40, 70, 0), image(90, 30, 1), image(40, 70, 2)  # A and C: the same size


CONVS = [
    chat("Describe", IM_A, "briefly please"),  # text before and after one image
    chat("First", IM_A, "then", IM_B, "compare them"),  # two images, text between
    chat(IM_B, "what now"),  # an image first
    chat("Three", IM_B, "one", IM_A, "two", image(60, 50, 3), "three"),  # three images of three sizes
]
OTHER = chat("Describe", IM_C, "briefly please")  # CONVS[0] with a different image of the same size
# two prompts that share an image and differ after it: with pages of 16 the second's cache hit (40 shared
# tokens, rounded down to 32) ends inside the image's run [21, 37)
FIRST = chat("Describe this picture", IM_A, "briefly please")
SEQUEL = chat("Describe this picture", IM_A, "in a word")
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def reference(ckpt):
    """transformers' greedy tokens for each conversation of CONVS, then OTHER; and CONVS[1]'s prompt
    logprobs (each prompt token's under the logits before it), with the decoder attending over images both
    ways and, without token_type_ids, causally."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(ckpt)
    model = Gemma3ForConditionalGeneration.from_pretrained(ckpt).eval()

    inputs = partial(chat_inputs, processor)

    def prompt_logprobs(conv: list[dict], bidirectional: bool) -> torch.Tensor:
        x = inputs(conv)
        if not bidirectional:
            x.pop("token_type_ids")
        with torch.no_grad():
            logp = torch.log_softmax(model(**x).logits[0, :-1].float(), -1)
        return logp.gather(1, x["input_ids"][0, 1:, None])[:, 0]

    tokens = hf_chat_greedy(model, inputs, [*CONVS, OTHER, SEQUEL], MAX_TOKENS)
    logprobs = {
        (i, both): prompt_logprobs(c, both) for i, c in ((1, CONVS[1]), (5, SEQUEL)) for both in (1, 0)
    }
    return tokens, logprobs


def test_prompt_logprobs_attend_over_images_both_ways(ckpt, reference):
    """Every prompt position's logprob equals transformers' with the bidirectional image mask, and the
    causal mask's differ (so this checks the mask, which greedy tokens of a tiny model may not show)."""
    both, causal = reference[1][1, 1], reference[1][1, 0]
    with LLM(str(ckpt), device="cpu", page_size=16, overlap=False) as llm:
        out = llm.chat(CONVS[1], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    got = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    torch.testing.assert_close(got, both, atol=1e-4, rtol=1e-4)
    assert (causal - both).abs().max() > 0.1


@pytest.mark.parametrize("options", greedy_cases(10, 24, "triton"))
def test_greedy_equals_transformers(ckpt, reference, options):
    """Overlap on with chunks of 10 (they end before or after images), the plain loop, the extend kernel."""
    if options.get("attention_backend") == "triton":
        pytest.importorskip("triton", reason="triton is not installed (or does not import here)")
    n = len(CONVS)  # (chunks never cut an image)
    check_greedy_chats(ckpt, options, CONVS, GREEDY, reference[0][:n], encoded=image_count(CONVS))


def test_prefix_cache_keys_images_by_content(ckpt, reference):
    tokens = reference[0]
    other = tokens[len(CONVS)]
    check_prefix_cache_keys_images(ckpt, CONVS[0], OTHER, GREEDY, tokens[0], other, rows=TOKENS_PER_IMAGE)


def test_a_prefix_hit_inside_an_image(ckpt, reference):
    """Pages of 16: a prompt sharing an earlier prompt's image but not its text after it hits the cache up
    to a page boundary inside the image's run; the image's other tokens are computed seeing the whole
    image (its cached tokens were, since a chunk never ends inside it)."""
    tokens = reference[0]
    with LLM(str(ckpt), device="cpu", page_size=16) as llm:
        first = llm.chat(FIRST, GREEDY, use_tqdm=False)[0]
        start = first.prompt_token_ids.index(llm.engine.vision.image_token_id)
        # the logprobs of the positions after the hit: from the image's uncached tokens on
        scored = SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.0, prompt_logprobs=0, prompt_logprobs_start=34
        )
        sequel = llm.chat(SEQUEL, scored, use_tqdm=False)[0]
        assert start < sequel.cached_tokens < start + TOKENS_PER_IMAGE  # the hit ends inside the image
        assert sequel.token_ids == tokens[len(CONVS) + 1]
        ids = sequel.prompt_token_ids
        got = torch.tensor([sequel.prompt_logprobs[i][ids[i]].logprob for i in range(34, len(ids))])
        both, causal = reference[1][5, 1][33:], reference[1][5, 0][33:]
        torch.testing.assert_close(got, both, atol=1e-4, rtol=1e-4)
        assert (
            causal[: start + TOKENS_PER_IMAGE - 33] - both[: start + TOKENS_PER_IMAGE - 33]
        ).abs().max() > 0.1
        llm.check_integrity()


def test_retraction_resumes_with_whole_images(ckpt, reference):
    """Requests retracted mid-decode resume (their prefix found in the radix cache, possibly ending inside
    an image, or recomputed) with pages of 1."""
    check_retraction(ckpt, CONVS, GREEDY, reference[0][: len(CONVS)], kv_cache_tokens=110, page_size=1)


def test_chunks_never_end_inside_an_image_that_attends_both_ways():
    both = PromptImage(10, 16, (), -5, bidirectional=True)
    causal = PromptImage(40, 16, (), -6)
    images = (both, causal)
    assert chunk_tokens(images, 0, 8) == 8  # ends before the image
    assert chunk_tokens(images, 0, 10) == 10  # ends at its start
    assert chunk_tokens(images, 0, 15) == 10  # would end inside: ends before it
    assert chunk_tokens(images, 10, 5) == 16  # starts at it: the whole image, past the budget
    assert chunk_tokens(images, 14, 5) == 12  # starts inside it (a prefix hit): to its end
    assert chunk_tokens(images, 0, 26) == 26  # ends at its end
    assert chunk_tokens(images, 30, 15) == 15  # a causal image may be cut


# google/gemma-3-4b-it's config.json as the Hub has it: its text_config keeps only what differs from
# Gemma3TextConfig's defaults (no heads, no vocabulary), with v4's rope_scaling
HUB_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def test_a_hub_config_is_filled_as_transformers_fills_it():
    from transformers import Gemma3Config

    from gapless.model.config import model_config_from_dict

    cfg = model_config_from_dict(HUB_4B, "config.json")
    ref = Gemma3Config(**HUB_4B).text_config
    assert (
        (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        == (8, 4, 256)
        == (
            ref.num_attention_heads,
            ref.num_key_value_heads,
            ref.head_dim,
        )
    )
    assert cfg.vocab_size == ref.vocab_size == 262208 and cfg.sliding_window == 1024
    assert cfg.window_layers == tuple((i + 1) % 6 != 0 for i in range(34))
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling["factor"] == 8.0 and cfg.local_rope_theta == 1e4
    spec = cfg.vision
    assert spec is not None and spec.bidirectional
    assert (spec.image_token_id, spec.image_size, spec.tokens_per_image) == (262144, 896, 256)
    assert spec.config["vision_config"]["layer_norm_eps"] == 1e-6  # SigLIP's default, filled in


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mm_tokens_per_image": 200}, "does not pool a 64 x 64 patch grid evenly"),
        ({"image_token_index": 300000}, "outside the text vocabulary"),
        ({"vision_config": {"model_type": "clip_vision_model"}}, "'clip_vision_model' vision tower"),
    ],
)
def test_unsupported_configs_are_refused_by_name(change, message):
    from gapless.model.config import model_config_from_dict

    with pytest.raises(ValueError, match=message):
        model_config_from_dict({**HUB_4B, **change}, "config.json")

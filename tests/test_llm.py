"""The offline `LLM` as a user holds it: leaving `with LLM(...)` gives everything back at once (no
reference cycle keeps the weights, KV pool or graphs until a garbage collection), later calls say the LLM
was shut down, two LLMs in a row both work; and `LLM.chat` renders conversations as the tokenizer does."""

from __future__ import annotations

import ctypes
import gc
import shutil
import weakref
from collections.abc import Iterator, Mapping

import pytest

from gapless import LLM, SamplingParams
from gapless.engine.engine import EngineShutDown

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
KV = dict(device="cpu", kv_cache_tokens=1024)


@pytest.fixture(scope="module")
def qwen3(ckpt_factory):
    return str(ckpt_factory("qwen3"))


@pytest.fixture()
def no_gc() -> Iterator[None]:
    """The garbage collector off: what is freed must be freed by reference counting alone."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _rss_mib() -> float:
    """The process's resident memory, after a collection (an earlier test's garbage, freed later, would
    offset what is measured) and glibc handing its free heap pages back (`malloc_trim`: else pages an
    earlier test freed may serve a new allocation, and the resident size would not show it)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # (not glibc)
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


# the plain in-process runner; CUDA graphs' padded static-buffer path (run eagerly on the CPU: the graph
# runner used to hold its runner's bound method, a cycle); the worker thread under chaos (its runner
# checks future-token slots)
@pytest.mark.parametrize(
    "options",
    [{}, {"cuda_graph_max_bs": 4}, {"overlap": True, "cpu_worker": "thread", "chaos_seed": 3}],
    ids=["inline", "graphs", "thread"],
)
def test_leaving_with_releases_everything_without_a_gc(qwen3, no_gc, options):
    with LLM(qwen3, **KV, **options) as llm:
        llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False)
        runner = llm.engine.runner
        stream = llm.engine.stream
        alive = {
            "runner": weakref.ref(runner),
            "model": weakref.ref(runner.model),
            "kv pool": weakref.ref(runner.kv_pool.k_buffer),
            "request table": weakref.ref(runner.req_table.device_table),
            "scheduler": weakref.ref(llm.engine.scheduler),
        }
        if options.get("cuda_graph_max_bs"):
            alive["graphs"] = weakref.ref(runner.graphs)
        # each weight too: a layer's loader bound on its own parameter was a cycle the model's death missed
        weights = {name: weakref.ref(p) for name, p in runner.model.named_parameters()}
        thread = getattr(getattr(stream, "stream", stream), "thread", None)
        del runner, stream
    # `llm` is still held here, as a user's variable would be
    assert [name for name, ref in alive.items() if ref() is not None] == []
    assert [name for name, ref in weights.items() if ref() is not None] == []
    assert thread is None or not thread.is_alive()


def test_a_failed_start_leaves_no_device_thread(qwen3, monkeypatch):
    from gapless.engine import engine as engine_module

    streams = []

    def failing_scheduler(cfg, stream, tokenizer):
        streams.append(stream)
        raise RuntimeError("scheduler failed")

    monkeypatch.setattr(engine_module, "Scheduler", failing_scheduler)
    with pytest.raises(RuntimeError, match="scheduler failed"):
        LLM(qwen3, **KV, overlap=True, cpu_worker="thread")
    assert not streams[0].thread.is_alive()


def test_memory_falls_back_when_the_block_ends(qwen3):
    LLM(qwen3, **KV).shutdown()  # first use: imports, kernels, allocator arenas
    before = _rss_mib()
    with LLM(qwen3, device="cpu", kv_cache_tokens=512 * 1024) as llm:  # 512 MiB of KV (1 KiB a token)
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        during = _rss_mib()
    after = _rss_mib()
    assert during - before > 400, (before, during)
    assert after - before < 100, (before, during, after)


def test_calls_after_shutdown_say_so_and_a_second_llm_works(qwen3):
    with LLM(qwen3, **KV) as first:
        expected = [o.token_ids for o in first.generate([[5, 6, 7]], GREEDY, use_tqdm=False)]
    for call in (
        lambda: first.generate([[5, 6, 7]], GREEDY, use_tqdm=False),
        lambda: first.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False),
        first.get_stats,
        first.check_integrity,
    ):
        with pytest.raises(EngineShutDown, match="LLM was shut down"):
            call()
    with pytest.raises(EngineShutDown, match="shut down"):
        first.engine.step()
    first.shutdown()  # again: nothing to do
    with LLM(qwen3, **KV) as second:
        assert [o.token_ids for o in second.generate([[5, 6, 7]], GREEDY, use_tqdm=False)] == expected
        second.check_integrity()


# ------------------------------------------------------------------------------------------- chat

CONVERSATIONS = [
    [{"role": "user", "content": "Hello, who are you?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is a radix tree?"},
        {"role": "assistant", "content": "A prefix tree."},
        {"role": "user", "content": "And a KV cache?"},
    ],
]
# ChatML, plus the switch Qwen3's template reads from chat_template_kwargs
THINKING_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)


def _template_ids(tokenizer, conv, **kw) -> list[int]:
    out = tokenizer.apply_chat_template(conv, add_generation_prompt=True, **kw)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


def test_chat_renders_as_the_tokenizer_does(qwen3):
    with LLM(qwen3, **KV) as llm:
        tok = llm.tokenizer
        one = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)  # one conversation
        many = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)  # a list of them
        assert len(one) == 1 and len(many) == 2
        for out, conv in zip(many, CONVERSATIONS):
            assert out.prompt_token_ids == _template_ids(tok, conv)
            assert out.prompt == tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
            assert len(out.token_ids) == GREEDY.max_tokens
        assert one[0].token_ids == many[0].token_ids
        # the same prompt through generate gives the same reply
        again = llm.generate([many[1].prompt_token_ids], GREEDY, use_tqdm=False)[0]
        assert again.token_ids == many[1].token_ids

        kwargs = {"enable_thinking": False}
        out = llm.chat(
            CONVERSATIONS[0],
            GREEDY,
            use_tqdm=False,
            chat_template=THINKING_TEMPLATE,
            chat_template_kwargs=kwargs,
        )[0]
        expected = _template_ids(tok, CONVERSATIONS[0], chat_template=THINKING_TEMPLATE, **kwargs)
        assert out.prompt_token_ids == expected
        assert out.prompt.endswith("<think>\n\n</think>\n\n")
        llm.check_integrity()


def test_chat_without_a_template_is_a_clear_error(qwen3, tmp_path):
    plain = tmp_path / "no-template"
    shutil.copytree(qwen3, plain)
    (plain / "chat_template.jinja").unlink()
    with LLM(str(plain), **KV) as llm:
        assert not llm.tokenizer.chat_template
        with pytest.raises(ValueError, match="no chat template"):
            llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)
        # nothing was queued, and plain prompts still work
        assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids) == 6
        llm.check_integrity()


def test_chat_checks_every_conversation_before_queueing_any(qwen3):
    with LLM(qwen3, device="cpu", kv_cache_tokens=1024, max_model_len=64) as llm:
        too_long = [{"role": "user", "content": "word " * 200}]
        with pytest.raises(ValueError, match="prompt is"):
            llm.chat([CONVERSATIONS[0], too_long], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="2 sampling params for 1 conversations"):
            llm.chat(CONVERSATIONS[0], [GREEDY, GREEDY], use_tqdm=False)
        assert llm.get_stats()["prefill_batches"] == 0
        llm.check_integrity()

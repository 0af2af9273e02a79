"""`gapless.engine.heap`: the heap a serving loop starts with is frozen for the loop's scope and
unfrozen after it (nothing stays frozen, no garbage is lost), and the collector's pauses are counted;
`LLM.generate` runs its steps with the heap frozen."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest

from gapless import LLM, SamplingParams
from gapless.engine.heap import frozen_heap, gc_pauses


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cycle collector frees it


@pytest.fixture()
def unfrozen():
    """A heap nothing froze, and the test leaves it so. A freeze an earlier test in this process left
    behind (the permanent generation is one per process, and `frozen_heap` rightly leaves a freeze it did
    not make alone) is undone first, with a warning that says so, rather than failing these tests for
    another's leak: `bench/gpu_session.sh suite` runs the suite with tests/bench/freeze_guard.py, which
    names the test that leaked."""
    gc.collect()
    if leftover := gc.get_freeze_count():
        warnings.warn(f"a test before this one left {leftover} objects frozen; unfrozen here", stacklevel=1)
        gc.unfreeze()
    yield
    assert gc.get_freeze_count() == 0, "the heap stayed frozen"


def test_the_scope_freezes_what_exists_and_unfreezes_it_after(unfrozen):
    kept = [_Node() for _ in range(10)]
    with frozen_heap():
        assert gc.get_freeze_count() >= len(kept)
        made = _Node()
        walked = {id(o) for o in gc.get_objects()}  # what a collection walks
        assert not any(id(n) in walked for n in kept)  # frozen
        assert id(made) in walked  # made inside the scope: collected as usual
    assert gc.get_freeze_count() == 0


def test_garbage_frozen_without_collect_is_collected_after_the_scope(unfrozen):
    cycle = _Node()
    dead = weakref.ref(cycle)
    del cycle
    with frozen_heap():
        gc.collect()
        assert dead() is not None  # frozen garbage waits for the scope to end
    gc.collect()
    assert dead() is None


def test_collect_first_freezes_no_garbage(unfrozen):
    cycle = _Node()
    dead = weakref.ref(cycle)
    del cycle
    with frozen_heap(collect=True):
        assert dead() is None


def test_the_start_up_freeze_is_counted_once_and_a_runs_not_at_all(unfrozen):
    """`gc.get_freeze_count` walks every frozen object: the stats report the count taken when the start-up
    freeze was made, not a new walk per stats request; a run's freeze (no collection) reports none."""
    pauses = gc_pauses()
    with frozen_heap(collect=True):
        counted = pauses.figures()["gc_frozen_objects"]
        assert counted >= gc.get_freeze_count() > 1000  # frozen objects may die since, none join
        _kept = [_Node() for _ in range(10)]  # made after the freeze: not frozen, the count stands
        assert pauses.figures()["gc_frozen_objects"] == counted
    assert pauses.figures()["gc_frozen_objects"] == 0
    with frozen_heap():
        assert pauses.figures()["gc_frozen_objects"] == 0


def test_nested_scopes_unfreeze_once_and_an_error_still_unfreezes(unfrozen):
    with pytest.raises(RuntimeError, match="boom"):
        with frozen_heap():
            with frozen_heap():
                pass
            assert gc.get_freeze_count() > 0  # the inner scope left the outer one's freeze alone
            raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_by_someone_else_is_left_as_it_is(unfrozen):
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            _made = [_Node() for _ in range(100)]  # a freeze made here would take these in
        # neither unfrozen nor frozen again: frozen objects may die meanwhile (another thread's), none join
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_pauses_are_counted():
    pauses = gc_pauses()
    before = pauses.figures()
    gc.collect()
    after = pauses.figures()
    assert after["gc_collections"] == before["gc_collections"] + 1
    assert after["gc_full_collections"] == before["gc_full_collections"] + 1
    assert after["gc_pause_s"] > before["gc_pause_s"]
    assert after["gc_longest_pause_ms"] > 0
    assert set(pauses.figures("api_")) == {f"api_{k}" for k in after}


def test_generate_steps_with_the_heap_frozen(ckpt_factory, unfrozen):
    with LLM(str(ckpt_factory("qwen3")), device="cpu", kv_cache_tokens=1024) as llm:
        frozen_at_steps: list[int] = []
        step = llm.engine.step

        def counting_step():
            frozen_at_steps.append(gc.get_freeze_count())
            return step()

        llm.engine.step = counting_step  # type: ignore[method-assign]
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0].token_ids) == 4
        assert frozen_at_steps and min(frozen_at_steps) > 10_000  # torch and transformers' objects
        assert gc.get_freeze_count() == 0
        stats = llm.get_stats()
        assert stats["gc_collections"] >= 0 and stats["gc_frozen_objects"] == 0


def test_a_freeze_left_by_an_earlier_test_is_undone_with_a_warning(request):
    """The fixture's own recovery: a leftover freeze is undone, and said so, before the test runs."""
    gc.freeze()
    try:
        with pytest.warns(UserWarning, match="objects frozen; unfrozen here"):
            request.getfixturevalue("unfrozen")
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()

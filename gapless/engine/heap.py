"""Python's cycle collector against a serving loop.

A full (generation 2) collection walks every object the process tracks. A process that has imported
torch and transformers tracks some 400,000 before it serves anything, so each full collection stops it
for 0.2-0.5 s on this project's 2-core CPU, and a burst of requests (their objects surviving the young
generations) sets one off: in the API server that stalls every stream at once, in the scheduler it leaves
the device idle. `frozen_heap` moves what the process holds when its loop starts into the permanent
generation (`gc.freeze`), so later collections walk only what the loop itself made; `gc_pauses` counts
what the collections still cost, for `Engine.get_stats` and the API server's /debug/state.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass

_depth = 0  # frozen_heap scopes open in this process: the outermost one freezes and unfreezes
# objects a start-up freeze (`frozen_heap(collect=True)`) froze, counted once then: `gc.get_freeze_count`
# walks the whole permanent generation (about 20 ms for 200,000 objects), too slow for every stats request
_startup_frozen = 0


@contextlib.contextmanager
def frozen_heap(collect: bool = False) -> Iterator[None]:
    """Freeze the process's heap for the scope of a serving loop, and unfreeze it when the loop ends.

    With `collect`, a full collection runs first, so no garbage is frozen: for a process that starts its
    loop once (a server's workers). Without it, entering and leaving cost nothing (`gc.freeze` and
    `gc.unfreeze` move lists, not objects) and garbage that is cyclic when the scope opens waits for the
    first collection after it closes: for a loop a caller's process runs many times (`LLM.generate`).
    Nested scopes leave it to the outermost one, and a heap someone else froze (the permanent generation
    is one per process) is left as it is. Unfreezing at the end matters beyond memory: objects still
    frozen at interpreter exit are never finalized, which native extensions report as leaks."""
    global _depth, _startup_frozen
    mine = _depth == 0 and gc.get_freeze_count() == 0  # (a walk: empty unless someone else froze)
    if mine:
        if collect:
            gc.collect()
        gc.freeze()
        if collect:
            _startup_frozen = gc.get_freeze_count()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if mine:
            gc.unfreeze()
            _startup_frozen = 0


@dataclass
class GcPauses:
    """The process's cycle-collector runs and the time they stopped it, since `gc_pauses` was first
    called (a callback on `gc.callbacks` counts them)."""

    collections: int = 0
    full_collections: int = 0  # generation 2: the ones that walk everything not frozen
    pause_s: float = 0.0
    longest_pause_s: float = 0.0
    _started: float = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        self.collections += 1
        self.full_collections += info["generation"] == 2
        self.pause_s += pause
        self.longest_pause_s = max(self.longest_pause_s, pause)

    def figures(self, prefix: str = "") -> dict[str, float | int]:
        """The counts and times under stats names (`prefix` first): the longest pause in ms, and how many
        objects the process's start-up freeze froze (`frozen_heap(collect=True)`, counted then: some may
        have been freed since; 0 outside one)."""
        return {
            f"{prefix}gc_frozen_objects": _startup_frozen,
            f"{prefix}gc_collections": self.collections,
            f"{prefix}gc_full_collections": self.full_collections,
            f"{prefix}gc_pause_s": self.pause_s,
            f"{prefix}gc_longest_pause_ms": self.longest_pause_s * 1e3,
        }


_pauses: GcPauses | None = None


def gc_pauses() -> GcPauses:
    """This process's collector pauses, counted from the first call on."""
    global _pauses
    if _pauses is None:
        _pauses = GcPauses()
        gc.callbacks.append(_pauses._callback)
    return _pauses

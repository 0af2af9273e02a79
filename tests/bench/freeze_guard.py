"""A pytest plugin (`-p freeze_guard`, with tests/bench on PYTHONPATH) for the GPU machine's suite run
(`bench/gpu_session.sh suite`): after each test, if the process's heap is left frozen (`gc.freeze`
without its `gc.unfreeze`), it names the test on stderr and in $GAPLESS_FREEZE_LOG, then unfreezes, so
that one leak is named once and does not fail the later tests that need an unfrozen heap."""

from __future__ import annotations

import gc
import os


def frozen_after(nodeid: str) -> str | None:
    """The line naming `nodeid` if the heap is frozen now (and the heap unfrozen), else None."""
    count = gc.get_freeze_count()
    if not count:
        return None
    gc.unfreeze()
    return f"FROZEN after {nodeid}: {count} objects left in the permanent generation (pid {os.getpid()})"


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    line = frozen_after(nodeid)
    if line is None:
        return
    print(f"\n{line}", flush=True)
    path = os.environ.get("GAPLESS_FREEZE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")

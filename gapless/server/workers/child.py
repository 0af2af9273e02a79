"""How a worker process lives and ends: it dies with its parent (`PR_SET_PDEATHSIG`), ignores SIGINT (a
terminal's Ctrl-C reaches the whole group; the API server decides), exits cleanly on SIGTERM (so a
shutdown never leaves a process behind), and reports a failure to the API server before it dies."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from collections.abc import Callable
from types import FrameType

from gapless import env
from gapless.server import protocol as P
from gapless.server.logs import configure_logging
from gapless.server.workers.sockets import FAILED_LINGER_MS, Sockets

_PR_SET_PDEATHSIG = 1


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def setup_child(parent_pid: int) -> None:
    """Die with the parent, leave Ctrl-C to it, exit cleanly (finally blocks run) on SIGTERM, and log
    at the server's level.

    The parent is the process that forked this one: the server, or its fork server (which exits when
    the server does, so the death signal still arrives)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass
    if not _alive(parent_pid):  # the server died before prctl took effect
        raise SystemExit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    configure_logging(env.LOG_LEVEL.get())


def run_worker(
    name: str, parent_pid: int, sockets: Callable[[], Sockets], body: Callable[[Sockets], None]
) -> None:
    """Run a worker's `body` on its sockets. A failure goes to the API server as `Failed` with its
    traceback, which the server prints (once: this process then exits with status 1 and prints nothing);
    a ValueError's message goes with it as a refusal (a checkpoint the loader refused, say), which a
    server still starting prints alone. A failure that cannot be sent is raised here, so the traceback
    is printed by this process instead."""
    setup_child(parent_pid)
    socks = sockets()
    linger_ms = 0  # a worker that ends cleanly drops what is unsent: nobody waits for it
    try:
        body(socks)
    except SystemExit:
        pass
    except BaseException as e:  # noqa: BLE001 - report, then die with an error (the API server exits)
        error, refusal = traceback.format_exc(), str(e) if isinstance(e, ValueError) else ""
        # what the failed frames hold (a weights file's progress bar, say) is let go now, not in the
        # SIGTERM the server answers with, whose SystemExit would land in its finalizer and print there
        traceback.clear_frames(e.__traceback__)
        # and this process ends on its own from here: the SIGTERM the server answers with would land in
        # an exit finalizer (a semaphore's unlink, leaving the resource tracker to warn of a leak)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        socks.send("api", P.Failed(name, error, refusal))  # (if this raises, both are printed)
        linger_ms = FAILED_LINGER_MS  # closing at once could drop the report before it is sent
        raise SystemExit(1) from None
    finally:
        socks.close(linger_ms)

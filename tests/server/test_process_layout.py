"""The process layouts (`--process-layout`, `gapless.server.layout`): `auto` picks `merged` (tokenizer and
detokenizer in one process) below 4 cores, and the merged layout serves exactly the tokens and text the
split one does: greedy and seeded sampling, chats, stop strings, streams, logprobs, refusals."""

from __future__ import annotations

import httpx
import pytest

from gapless.server.layout import choose_layout
from gapless.testing.server import ServerProcess, alive, wait_until
from tests.server.conftest import API_KEY, same_answers


def test_auto_merges_below_four_cores():
    assert [choose_layout("auto", cores) for cores in (1, 2, 3, 4, 16)] == ["merged"] * 3 + ["split"] * 2
    assert choose_layout("split", 1) == "split" and choose_layout("merged", 64) == "merged"
    with pytest.raises(ValueError, match="process layout must be one of auto, split, merged"):
        choose_layout("single")


@pytest.mark.slow  # (two servers, ~10 s)
def test_merged_layout_serves_the_same_tokens_as_split(server, session_answers):
    """The session's server runs the layout `auto` picks here; a second one, the other layout, on the
    same model and options: both answer every request alike, to the token."""
    other = "split" if choose_layout("auto") == "merged" else "merged"
    names = {
        "merged": {"scheduler", "tokenizer+detokenizer"},
        "split": {"scheduler", "tokenizer", "detokenizer"},
    }
    args = server.proc.args[server.proc.args.index("--port") + 2 :]  # its model and options, as given
    srv = ServerProcess(*args, "--process-layout", other)
    workers = srv.workers()
    try:
        assert f"process layout {other} (--process-layout)" in srv.output
        headers = {"Authorization": f"Bearer {API_KEY}"}
        for s, layout in ((server, choose_layout("auto")), (srv, other)):
            pids = httpx.get(f"{s.url}/debug/state", headers=headers, timeout=30).json()["worker_pids"]
            assert set(pids) == names[layout], pids
        assert same_answers(srv.url) == session_answers
    finally:
        assert srv.stop() == 0, srv.output
    assert wait_until(lambda: not any(alive(p) for p in workers), 10), "workers outlived the server"

"""The server's processes serve with the heap their start-up built frozen (`gapless.engine.heap`), and
/debug/state shows the collector's figures of the scheduler's process and of the API server's."""

from __future__ import annotations

from tests.server.conftest import debug_state


def test_scheduler_and_api_server_serve_with_their_start_up_heap_frozen(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    state = debug_state(client)
    # both imported torch and transformers (the API server to check the configuration): far more than this
    assert state["gc_frozen_objects"] > 10_000
    assert state["api_gc_frozen_objects"] > 10_000
    for prefix in ("", "api_"):
        assert state[f"{prefix}gc_collections"] >= state[f"{prefix}gc_full_collections"] >= 1  # start-up's
        assert state[f"{prefix}gc_pause_s"] > 0

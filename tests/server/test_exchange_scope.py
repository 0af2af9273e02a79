"""Around every HTTP exchange: an exception no handler answers becomes a JSON 500 that tells nothing of
the server's internals, and whatever the exchange submitted is released, however it ended."""

from __future__ import annotations

from fastapi import Request
from fastapi.testclient import TestClient

from gapless.server.api import create_app
from gapless.server.engine_client import Group
from gapless.server.health import Health
from gapless.server.metrics import Metrics
from gapless.server.protocol import SchedulerInfo
from gapless.server.routes.common import owned_by_exchange
from gapless.server.state import ServerState, Settings


class _Client:
    """Stands in for the engine client: records what is released."""

    def __init__(self) -> None:
        self.released: list[Group] = []

    def release(self, group: Group) -> None:
        self.released.append(group)


def test_an_unexpected_exception_is_a_json_500_that_releases_what_the_exchange_submitted():
    client = _Client()
    settings = Settings("m", "/models/m", SchedulerInfo(64, 64, "cpu", 100, 2048))
    app = create_app(ServerState(settings, client, Health(), Metrics("m")))  # type: ignore[arg-type]
    group, other = Group(["a-0", "a-1"]), Group(["b-0"])

    @app.get("/boom")
    async def boom(request: Request) -> None:
        owned_by_exchange(request, group)
        raise RuntimeError("secret: /home/someone/.key")

    @app.get("/fine")
    async def fine(request: Request) -> dict:
        owned_by_exchange(request, other)
        return {"ok": True}

    with TestClient(app) as http:
        r = http.get("/boom")
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error" and "secret" not in r.text
        assert client.released == [group]
        assert http.get("/fine").json() == {"ok": True}
        assert client.released == [group, other]

"""Remote images (`gapless.server.media`): fetched from a local HTTP server on 127.0.0.1 in the test, under
a policy that lets a test reach loopback (`allow_private`, which no flag sets); refused, each a 400 naming
the part, when remote media is off (naming the flags), when the host is not an allowed domain, when it
resolves to a private address (loopback here), when the body is too large, when it takes too long, on
an HTTP error and on too many redirects; fetched off the event loop; and through the chat route."""

from __future__ import annotations

import asyncio
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from gapless.server import media
from gapless.server.errors import BadRequest
from gapless.server.media import MediaPolicy, RemoteImage, fetch_images, is_public

PART = "messages[0].content[1]"
OPEN = MediaPolicy(allow_remote=True, timeout_s=5.0, allow_private=True)  # a test's: loopback allowed


def _png(seed: int = 0) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (12, 9), (seed * 40 % 256, 30, 90)).save(buf, format="PNG")
    return buf.getvalue()


PNG = _png()


class _Handler(BaseHTTPRequestHandler):
    hits: list[str] = []

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.hits.append(self.path)
        port, path = self.server.server_address[1], self.path.split("?")[0]
        if path == "/img.png":
            self._send(200, PNG, {"Content-Type": "image/png", "Content-Length": str(len(PNG))})
        elif self.path == "/big":  # a Content-Length past the limit
            self._send(200, b"x" * 5000, {"Content-Length": "5000"})
        elif self.path == "/big-unsized":  # no length: read until the limit is passed
            self.close_connection = True
            self._send(200, b"x" * 5000)
        elif self.path == "/slow":  # nothing for a second
            time.sleep(1.0)
            self._send(200, PNG, {"Content-Length": str(len(PNG))})
        elif self.path == "/drip":  # a byte every 50 ms: each read is quick, the whole is not
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
        elif self.path == "/redirect":
            self._send(302, headers={"Location": "/img.png", "Content-Length": "0"})
        elif self.path == "/loop":
            self._send(302, headers={"Location": "/loop", "Content-Length": "0"})
        elif self.path == "/elsewhere":  # to another loopback address
            self._send(302, headers={"Location": f"http://127.0.0.2:{port}/img.png", "Content-Length": "0"})
        else:
            self._send(404, b"no", {"Content-Length": "2"})


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:  # a client that gave up: quiet
        pass


@pytest.fixture(scope="module")
def site():
    server = _Server(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _fetch(urls: list[str], policy: MediaPolicy) -> dict[str, bytes]:
    return asyncio.run(fetch_images([RemoteImage(u, PART) for u in urls], policy))


def _refused(url: str, policy: MediaPolicy, says: str) -> None:
    with pytest.raises(BadRequest, match=says) as e:
        _fetch([url], policy)
    assert e.value.status == 400 and e.value.param == PART and str(e.value).startswith(PART)


def test_fetches_an_image_each_url_once(site):
    _Handler.hits.clear()
    url = f"{site}/img.png"
    assert _fetch([url, url], OPEN) == {url: PNG}
    assert _Handler.hits == ["/img.png"]
    assert _fetch([f"{site}/redirect"], OPEN) == {f"{site}/redirect": PNG}  # a redirect followed
    assert _fetch([f"{site}/img.png?v=2#part"], OPEN)
    assert _Handler.hits[-1] == "/img.png?v=2"  # the query sent, the fragment not


def test_off_unless_a_flag_says_so(site):
    _Handler.hits.clear()
    _refused(f"{site}/img.png", MediaPolicy(), "--allow-remote-media, or --allowed-media-domains")
    assert not _Handler.hits


def test_only_the_allowed_domains(site):
    _Handler.hits.clear()
    only = MediaPolicy(domains=frozenset({"images.example.org"}), allow_private=True)
    _refused(f"{site}/img.png", only, "'127.0.0.1' is not in this server's --allowed-media-domains")
    assert not _Handler.hits
    assert _fetch([f"{site}/img.png"], only._replace(domains=frozenset({"127.0.0.1"})))


def test_loopback_and_private_hosts_are_refused(site, monkeypatch):
    _Handler.hits.clear()
    _refused(f"{site}/img.png", MediaPolicy(allow_remote=True), "resolves to 127.0.0.1, a private")
    _refused("http://localhost/x.png", MediaPolicy(allow_remote=True), "private, loopback or link-local")
    assert not _Handler.hits
    # a redirect is checked as the first URL is: 127.0.0.1 taken as public, the redirect's 127.0.0.2 not
    monkeypatch.setattr(media, "is_public", lambda address: address == "127.0.0.1")
    _refused(f"{site}/elsewhere", MediaPolicy(allow_remote=True), "resolves to 127.0.0.2, a private")
    assert _Handler.hits == ["/elsewhere"]


@pytest.mark.parametrize(
    "address, public",
    [
        ("8.8.8.8", True),
        ("2606:4700:4700::1111", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # a cloud's metadata service
        ("100.64.0.1", False),  # shared address space
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("fe80::1%eth0", False),
        ("fd00::1", False),
        ("::ffff:127.0.0.1", False),  # loopback, mapped into IPv6
    ],
)
def test_which_addresses_are_public(address, public):
    assert is_public(address) is public


@pytest.mark.parametrize(
    "path, says",
    [
        ("/big", "5000 bytes, more than this server's limit of 1000 \\(--max-media-bytes\\)"),
        ("/big-unsized", "more than 1000 bytes, more than this server's limit"),
        ("/slow", "took longer than 0.3 s \\(--media-fetch-timeout\\)"),
        ("/drip", "took longer than 0.3 s"),
        ("/missing", "answered HTTP 404"),
        ("/loop", "redirects more than 3 times"),
    ],
)
def test_limits_and_failures_are_refused(site, path, says):
    start = time.monotonic()
    _refused(f"{site}{path}", OPEN._replace(max_bytes=1000, timeout_s=0.3), says)
    assert time.monotonic() - start < 0.9  # the timeout holds for the fetch in all


@pytest.mark.parametrize(
    "url, says",
    [
        ("ftp://example.com/x.png", "only http and https"),
        ("http://user:pw@example.com/x.png", "with credentials"),
        ("http://example.com:99999/x.png", "malformed"),
    ],
)
def test_bad_urls_are_refused_before_any_lookup(url, says):
    _refused(url, MediaPolicy(allow_remote=True), says)


def test_fetching_leaves_the_event_loop_free(site):
    async def run() -> int:
        ticks = 0
        fetch = asyncio.ensure_future(fetch_images([RemoteImage(f"{site}/slow", PART)], OPEN))
        while not fetch.done():
            await asyncio.sleep(0.01)
            ticks += 1
        assert fetch.result()[f"{site}/slow"] == PNG
        return ticks

    assert asyncio.run(run()) > 30  # the loop ran on through the second the server took


class _Client:
    """Stands in for the engine client: records the submission and answers one finished delta."""

    def __init__(self) -> None:
        self.subs: list = []

    def submit(self, sub, max_prompt_tokens, timeout_s):
        from gapless.server.engine_client import Group
        from gapless.server.protocol import ReqDelta

        self.subs.append(sub)
        group = Group(["r-0"])
        group.open.clear()
        group.queue.put_nowait((0, ReqDelta("r-0", "ok", [1], 3, 1, 0, finish_reason="stop")))
        return group

    def release(self, group) -> None:
        pass


def test_the_chat_route_fetches_before_submitting(site):
    from gapless.server.api import create_app
    from gapless.server.health import Health
    from gapless.server.metrics import Metrics
    from gapless.server.protocol import SchedulerInfo
    from gapless.server.state import ServerState, Settings

    info = SchedulerInfo(64, 64, "cpu", 100, 2048, image_limits=(2, 10_000))
    client = _Client()

    def post(policy: MediaPolicy, *urls: str):
        parts = [{"type": "text", "text": "a"}]
        parts += [{"type": "image_url", "image_url": {"url": u, "detail": "auto"}} for u in urls]
        settings = Settings("m", "/models/m", info, media=policy)
        app = create_app(ServerState(settings, client, Health(), Metrics("m")))  # type: ignore[arg-type]
        with TestClient(app) as http:
            body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}
            return http.post("/v1/chat/completions", json=body)

    data = "data:image/png;base64," + __import__("base64").b64encode(_png(1)).decode()
    r = post(OPEN, data, f"{site}/img.png")
    assert r.status_code == 200, r.text
    assert client.subs[-1].prompts[0].images == [_png(1), PNG]  # in the parts' order
    r = post(MediaPolicy(allow_remote=True), data, f"{site}/img.png")  # loopback: refused, nothing queued
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[2]"
    r = post(OPEN, f"{site}/img.png", f"{site}/img.png", data)  # 3 images, limit 2: before any fetch
    assert r.status_code == 400 and "3 images in one prompt" in r.json()["error"]["message"]
    assert len(client.subs) == 1


def test_the_flags_make_the_policy():
    from gapless.__main__ import parse_args

    assert MediaPolicy.of_args(parse_args(["serve"])) == MediaPolicy()  # off
    args = parse_args(["serve", "--allowed-media-domains", "Images.Example.org", "cdn.example.com."])
    policy = MediaPolicy.of_args(args)
    assert policy.enabled and not policy.allow_remote and not policy.allow_private
    assert policy.domains == {"images.example.org", "cdn.example.com"}
    args = parse_args(
        ["serve", "--allow-remote-media", "--max-media-bytes", "4096", "--media-fetch-timeout", "2"]
    )
    assert MediaPolicy.of_args(args) == MediaPolicy(True, None, 4096, 2.0)
    for bad in (["--max-media-bytes", "0"], ["--media-fetch-timeout", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(["serve", *bad])

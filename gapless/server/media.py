"""Remote images: the `http(s)` image URLs of a chat, fetched by the API server on the client's behalf.

Off unless the server was started with `--allow-remote-media` (any public host) or
`--allowed-media-domains HOST ...` (those hosts only). A fetch takes at most `--media-fetch-timeout`
seconds in all and `--max-media-bytes` bytes; it follows at most `MAX_REDIRECTS` redirects, and every
host it meets, the first and each redirect's, is resolved and refused if any of its addresses is not a
public one (private, loopback, link-local, shared, reserved, multicast): the connection then goes to an
address so checked, so a second lookup cannot point it elsewhere. The fetches run in a thread pool of
their own, so the event loop never waits on them; a refused or failed fetch is a 400 naming the part
(`messages[0].content[1]`) before anything is queued.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import urljoin, urlsplit

from gapless.server.errors import BadRequest

if TYPE_CHECKING:  # (imported where used: `gapless serve --help` reads this module's defaults)
    import http.client
    from concurrent.futures import ThreadPoolExecutor

MAX_REDIRECTS = 3  # redirects one fetch follows, each checked as the first URL is
DEFAULT_MAX_MEDIA_BYTES = 20 << 20  # --max-media-bytes: the largest image body fetched
DEFAULT_FETCH_TIMEOUT_S = 10.0  # --media-fetch-timeout: one fetch in all, redirects included
FETCH_THREADS = 8  # fetches at once in one API server; more wait their turn
_CHUNK = 1 << 16
_REDIRECTS = (301, 302, 303, 307, 308)
REMOTE_OFF = (
    "remote image URLs are not fetched by this server (start it with --allow-remote-media, or "
    "--allowed-media-domains HOST ...), send the image as a data: URL (base64)"
)


class MediaPolicy(NamedTuple):
    """Which remote image URLs the API server fetches, and within what limits."""

    allow_remote: bool = False  # --allow-remote-media: any public host
    domains: frozenset[str] | None = None  # --allowed-media-domains: only these hosts (None: no list)
    max_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    allow_private: bool = False  # tests only (a server on 127.0.0.1): no flag sets it

    @property
    def enabled(self) -> bool:
        return self.allow_remote or self.domains is not None

    @classmethod
    def of_args(cls, args: argparse.Namespace) -> MediaPolicy:
        domains = getattr(args, "allowed_media_domains", None)
        return cls(
            bool(getattr(args, "allow_remote_media", False)),
            frozenset(d.lower().rstrip(".") for d in domains) if domains else None,
            getattr(args, "max_media_bytes", DEFAULT_MAX_MEDIA_BYTES),
            getattr(args, "media_fetch_timeout", DEFAULT_FETCH_TIMEOUT_S),
        )


class RemoteImage(NamedTuple):
    """An `http(s)` image URL of a request and the part it is in (`messages[0].content[1]`)."""

    url: str
    param: str


class FetchError(ValueError):
    """A remote image that is not fetched: the URL refused, or the fetch failed."""


def is_remote(url: object) -> bool:
    return isinstance(url, str) and url[:8].lower().startswith(("http://", "https://"))


def check_url(url: str, policy: MediaPolicy) -> tuple[str, str, int]:
    """(scheme, host, port) of a URL the policy lets the server fetch; FetchError saying why not."""
    if not policy.enabled:
        raise FetchError(REMOTE_OFF)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise FetchError(f"the image URL is malformed ({e})") from None
    scheme, host = parts.scheme.lower(), (parts.hostname or "").rstrip(".")
    if scheme not in ("http", "https") or not host:
        raise FetchError(f"only http and https image URLs with a host are fetched, not {url[:80]!r}")
    if parts.username is not None or parts.password is not None:
        raise FetchError("an image URL with credentials (user@host) is not fetched")
    try:
        host = host.encode("idna").decode("ascii")  # an international name as DNS and HTTP carry it
    except UnicodeError:
        raise FetchError(f"the image URL's host {host[:80]!r} is not a valid host name") from None
    if policy.domains is not None and host not in policy.domains:
        raise FetchError(f"the host {host!r} is not in this server's --allowed-media-domains")
    return scheme, host, port or (443 if scheme == "https" else 80)


def is_public(address: str) -> bool:
    """Whether an IP address is one a fetch may reach: globally routable, not multicast."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def resolve(host: str, port: int, policy: MediaPolicy) -> list[str]:
    """Every address `host` resolves to; FetchError if one is not public (unless `allow_private`)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise FetchError(f"cannot resolve the image URL's host {host!r} ({e})") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for a in addresses:
        if not policy.allow_private and not is_public(a):
            raise FetchError(
                f"the image URL's host {host!r} resolves to {a}, a private, loopback or link-local "
                "address, which is never fetched"
            )
    return addresses


def _connection(
    scheme: str, host: str, port: int, address: str, timeout: float
) -> tuple[http.client.HTTPConnection, socket.socket]:
    """An HTTP(S) connection to `host` made to the checked `address` (TLS checked against `host`), and
    its socket."""
    import http.client
    import ssl

    sock = socket.create_connection((address, port), timeout=timeout)
    if scheme == "https":
        try:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
    conn = (http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection)(
        host, port, timeout=timeout
    )
    conn.sock = sock  # already connected: `connect` is never called
    return conn, sock


def _timed_out(policy: MediaPolicy) -> str:
    return f"fetching the image took longer than {policy.timeout_s:g} s (--media-fetch-timeout)"


def _remaining(deadline: float, policy: MediaPolicy) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise FetchError(_timed_out(policy))
    return left


def _get(url: str, policy: MediaPolicy, deadline: float) -> tuple[int, str | None, bytes]:
    """One GET of `url`, checked: (status, its Location header, the body if the status is 200)."""
    scheme, host, port = check_url(url, policy)
    addresses = resolve(host, port, policy)
    error: OSError | None = None
    for address in addresses:
        try:
            conn, sock = _connection(scheme, host, port, address, _remaining(deadline, policy))
            break
        except OSError as e:
            error = e
    else:
        raise FetchError(f"cannot connect to {host!r} ({error})")
    try:
        parts = urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"Accept": "image/*", "User-Agent": "gapless"})
        response = conn.getresponse()
        if response.status != 200:
            return response.status, response.getheader("Location"), b""
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > policy.max_bytes:
            raise FetchError(_too_large(f"{int(length)} bytes", policy))
        body = bytearray()
        while True:
            if not response.isclosed():  # (once the body is read, the response may close the socket)
                sock.settimeout(_remaining(deadline, policy))
            chunk = response.read1(_CHUNK)  # what one receive brings: the deadline is checked between
            if not chunk:
                return 200, None, bytes(body)
            body += chunk
            if len(body) > policy.max_bytes:
                raise FetchError(_too_large(f"more than {policy.max_bytes} bytes", policy))
    finally:
        conn.close()


def _too_large(size: str, policy: MediaPolicy) -> str:
    return f"the image is {size}, more than this server's limit of {policy.max_bytes} (--max-media-bytes)"


def fetch(url: str, policy: MediaPolicy) -> bytes:
    """The body of an image URL under `policy`, following up to `MAX_REDIRECTS` redirects, each checked;
    FetchError saying why not. Blocks: the server runs it in `fetch_images`' threads."""
    import http.client

    deadline = time.monotonic() + policy.timeout_s
    try:
        for _ in range(MAX_REDIRECTS + 1):
            status, location, body = _get(url, policy, deadline)
            if status == 200:
                return body
            if status not in _REDIRECTS or not location:
                raise FetchError(f"the image URL answered HTTP {status}")
            url = urljoin(url, location)
    except TimeoutError:  # a socket's timeout is the time left: the fetch ran out of it
        raise FetchError(_timed_out(policy)) from None
    except (OSError, http.client.HTTPException) as e:
        raise FetchError(f"fetching the image failed ({type(e).__name__}: {e})") from None
    raise FetchError(f"the image URL redirects more than {MAX_REDIRECTS} times")


_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    from concurrent.futures import ThreadPoolExecutor

    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="gapless-media")
    return _pool


async def fetch_images(images: Sequence[RemoteImage], policy: MediaPolicy) -> dict[str, bytes]:
    """Each remote image's bytes by URL (each URL fetched once, all at once, off the event loop); a
    BadRequest naming the first part whose URL is refused or whose fetch fails."""
    import asyncio

    first: dict[str, str] = {}
    for im in images:
        try:
            check_url(im.url, policy)  # refused by the policy: answered before anything is fetched
        except FetchError as e:
            raise BadRequest(f"{im.param}: {e}", im.param) from None
        first.setdefault(im.url, im.param)
    if not first:
        return {}
    loop = asyncio.get_running_loop()
    jobs = [
        asyncio.wait_for(loop.run_in_executor(_threads(), fetch, url, policy), policy.timeout_s + 1)
        for url in first
    ]
    got = await asyncio.gather(*jobs, return_exceptions=True)
    for param, result in zip(first.values(), got):
        if isinstance(result, BaseException):
            if isinstance(result, TimeoutError):
                result = FetchError(_timed_out(policy))
            elif not isinstance(result, FetchError):
                result = FetchError(f"fetching the image failed ({type(result).__name__})")
            raise BadRequest(f"{param}: {result}", param)
    return {url: body for url, body in zip(first, got) if isinstance(body, bytes)}

"""``image_reference`` by https URL: off by default, allowed hosts only, public addresses
only, bounded in size, time and redirects, and cancellable.

Every test talks to a real HTTPS server on 127.0.0.1 with a trustme certificate for the
made-up names ``images.test`` and ``other.test``. The fetcher reaches it through its
test-only injection points (a resolver mapping those names to 127.0.0.1, a policy that
allows loopback, the trustme CA); the tests of the defaults leave them out and show that
the defaults refuse that very server.
"""

from __future__ import annotations

import io
import ipaddress
import json
import ssl
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import attrs
import av
import h11
import numpy as np
import pytest
import trio
import trustme

from tests.conftest import Transcript, receive_into
from trio_vstream.media.image_fetch import (
    DISABLED_REASON,
    ImageFetchConfig,
    ImageFetchError,
    IPAddress,
    fetch_image,
    public_addresses_only,
)
from trio_vstream.protocol import ImageInput, ImageURL

NAMES = ("images.test", "other.test")


def png_of(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="image2pipe") as container:
        stream = container.add_stream("png", rate=1)
        stream.width, stream.height, stream.pix_fmt = image.shape[1], image.shape[0], "rgb24"
        for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


PIXELS = np.zeros((20, 30, 3), np.uint8)
PIXELS[..., 2] = 180
PNG = png_of(PIXELS)


# ----------------------------------------------------------------- the image host


@attrs.define
class Reply:
    """What the image host answers for one path."""

    status: int = 200
    headers: list[tuple[str, str]] = attrs.field(factory=lambda: [("Content-Type", "image/png")])
    body: bytes = PNG
    stall: bool = False
    """Read the request, then never answer (until the client goes away)."""
    endless: bool = False
    """Answer 200 image/png with a chunked body that never ends."""
    hold: trio.Event | None = None
    """Answer only once this is set."""


@attrs.define
class ImageHost:
    """A small HTTPS server on 127.0.0.1 that records what it was asked."""

    port: int = 0
    routes: dict[str, Reply] = attrs.field(factory=dict)
    connections: int = 0
    requests: list[tuple[str, str]] = attrs.field(factory=list)
    """(Host header, target) of each request."""
    server_names: list[str | None] = attrs.field(factory=list)
    """The SNI name of each TLS handshake."""
    request_seen: trio.Event = attrs.field(factory=trio.Event)
    client_left: trio.Event = attrs.field(factory=trio.Event)
    """Set when a stalled or endless answer noticed the client close the connection."""

    def url(self, path: str, name: str = "images.test") -> str:
        return f"https://{name}:{self.port}{path}"

    async def handle(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        self.connections += 1
        connection = h11.Connection(h11.SERVER)
        try:
            event = connection.next_event()
            while event is h11.NEED_DATA:
                connection.receive_data(await stream.receive_some(65536))
                event = connection.next_event()
            if not isinstance(event, h11.Request):
                return
            headers = dict(event.headers)
            self.requests.append((headers[b"host"].decode(), event.target.decode()))
            self.request_seen.set()
            reply = self.routes.get(event.target.decode(), Reply(404, [], b"no such image"))
            if reply.stall:
                while await stream.receive_some(65536):
                    pass
                self.client_left.set()
                return
            if reply.hold is not None:
                await reply.hold.wait()
            length = [] if reply.endless else [("Content-Length", str(len(reply.body)))]
            response = h11.Response(status_code=reply.status, headers=reply.headers + length)
            await stream.send_all(connection.send(response) or b"")
            if reply.endless:
                while True:
                    await stream.send_all(connection.send(h11.Data(data=bytes(65536))) or b"")
            await stream.send_all(
                (connection.send(h11.Data(data=reply.body)) or b"")
                + (connection.send(h11.EndOfMessage()) or b"")
            )
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.client_left.set()
        finally:
            await trio.aclose_forcefully(stream)


@pytest.fixture(scope="module")
def authority() -> trustme.CA:
    return trustme.CA()


def trusting(authority: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    authority.configure_trust(context)
    return context


@pytest.fixture
async def image_host(nursery: trio.Nursery, authority: trustme.CA) -> ImageHost:
    return await serve_image_host(nursery, authority)


async def serve_image_host(nursery: trio.Nursery, authority: trustme.CA) -> ImageHost:
    """An `ImageHost` on a free port of 127.0.0.1, until ``nursery`` ends."""
    host = ImageHost()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert(*NAMES, "127.0.0.1").configure_cert(context)
    context.sni_callback = lambda _sock, name, _ctx: host.server_names.append(name)  # type: ignore[assignment,func-returns-value]
    listeners = await nursery.start(
        partial(
            trio.serve_ssl_over_tcp,
            host.handle,
            0,
            context,
            host="127.0.0.1",
            https_compatible=True,
        )
    )
    host.port = listeners[0].transport_listener.socket.getsockname()[1]
    return host


async def loopback_resolver(name: str, _port: int) -> Sequence[IPAddress]:
    """The test names all live on 127.0.0.1 (a test injection point)."""
    if name not in NAMES:
        raise OSError(f"unknown test name {name}")
    return [ipaddress.ip_address("127.0.0.1")]


def allow_loopback(address: IPAddress) -> str | None:
    """The test policy: production's, except that loopback is allowed."""
    return None if address.is_loopback else public_addresses_only(address)


# A helper (__test__ = False below), not a test: its defaults are fine (PT028).
def test_config(
    authority: trustme.CA,
    host: ImageHost,
    names: Sequence[str] = ("images.test",),  # noqa: PT028
    **changes: Any,
) -> ImageFetchConfig:
    """A fetcher config that may reach the image host (every injection point set), on
    its port (not 443: the host must be listed with it)."""
    return ImageFetchConfig(
        allowed_hosts=frozenset(f"{name}:{host.port}" for name in names),
        ssl_context=trusting(authority),
        address_policy=allow_loopback,
        resolver=loopback_resolver,
        **changes,
    )


test_config.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


async def refusal(fetch: Awaitable[ImageInput]) -> str:
    with trio.fail_after(10), pytest.raises(ImageFetchError) as caught:
        await fetch
    return str(caught.value)


# ------------------------------------------------------------------ the fetcher


async def test_an_allowed_host_gives_the_image_and_is_asked_by_name(
    image_host: ImageHost, authority: trustme.CA
) -> None:
    image_host.routes["/cat.png?v=2"] = Reply()
    url = ImageURL.parse(image_host.url("/cat.png?v=2#frag"))
    with trio.fail_after(10):
        image = await fetch_image(url, test_config(authority, image_host))
    assert image == ImageInput(mime_type="image/png", data=PNG)
    # Connected to the vetted address, but SNI and Host carry the name (no re-resolution).
    assert image_host.requests == [(f"images.test:{image_host.port}", "/cat.png?v=2")]
    assert image_host.server_names == ["images.test"]


async def test_off_by_default(image_host: ImageHost) -> None:
    image_host.routes["/cat.png"] = Reply()
    url = ImageURL.parse(image_host.url("/cat.png"))
    message = await refusal(fetch_image(url, ImageFetchConfig()))
    assert message == f"image_reference.image_url {url.url!r}: {DISABLED_REASON}"
    assert "--allow-image-urls" in message and "data:image" in message
    assert image_host.connections == 0


async def test_a_host_not_listed_is_refused_before_any_connection(
    image_host: ImageHost, authority: trustme.CA
) -> None:
    image_host.routes["/cat.png"] = Reply()
    url = ImageURL.parse(image_host.url("/cat.png", name="other.test"))
    message = await refusal(fetch_image(url, test_config(authority, image_host)))
    assert "its host 'other.test' is not one this server fetches from" in message
    assert "--allow-image-urls" in message
    assert image_host.connections == 0


async def test_a_redirect_to_a_host_not_listed_is_not_followed(
    image_host: ImageHost, authority: trustme.CA
) -> None:
    target = image_host.url("/cat.png", name="other.test")
    image_host.routes["/moved"] = Reply(302, [("Location", target)], b"")
    image_host.routes["/cat.png"] = Reply()
    url = ImageURL.parse(image_host.url("/moved"))
    message = await refusal(fetch_image(url, test_config(authority, image_host)))
    assert f"it redirects to {target!r}, whose host 'other.test' is not one" in message
    assert message.startswith(f"image_reference.image_url {url.url!r}: ")
    assert image_host.requests == [(f"images.test:{image_host.port}", "/moved")]


async def test_redirects_within_the_list_are_followed(
    image_host: ImageHost, authority: trustme.CA
) -> None:
    image_host.routes["/a"] = Reply(301, [("Location", image_host.url("/b", "other.test"))], b"")
    image_host.routes["/b"] = Reply(307, [("Location", "/cat.png")], b"")  # relative
    image_host.routes["/cat.png"] = Reply()
    config = test_config(authority, image_host, names=NAMES)
    with trio.fail_after(10):
        image = await fetch_image(ImageURL.parse(image_host.url("/a")), config)
    assert image.data == PNG
    port = image_host.port
    assert image_host.requests == [
        (f"images.test:{port}", "/a"),
        (f"other.test:{port}", "/b"),
        (f"other.test:{port}", "/cat.png"),
    ]


async def test_redirects_are_bounded_and_must_stay_https(
    image_host: ImageHost, authority: trustme.CA
) -> None:
    image_host.routes["/loop"] = Reply(302, [("Location", "/loop")], b"")
    image_host.routes["/plain"] = Reply(302, [("Location", "http://images.test/cat.png")], b"")
    config = test_config(authority, image_host, max_redirects=2)
    loop = await refusal(fetch_image(ImageURL.parse(image_host.url("/loop")), config))
    assert loop.endswith(": more than 2 redirects")
    assert len(image_host.requests) == 3
    plain = await refusal(fetch_image(ImageURL.parse(image_host.url("/plain")), config))
    assert "it redirects to 'http://images.test/cat.png', which must be an https:// URL" in plain


async def test_a_body_over_the_limit_is_refused_and_reading_stops(
    image_host: ImageHost, authority: trustme.CA
) -> None:
    image_host.routes["/big.png"] = Reply(body=bytes(5000))
    image_host.routes["/endless.png"] = Reply(endless=True)
    config = test_config(authority, image_host, max_bytes=4096)
    declared = await refusal(fetch_image(ImageURL.parse(image_host.url("/big.png")), config))
    assert declared.endswith(": the image is larger than 4096 bytes (the server's limit)")
    # No Content-Length and a body that never ends: only stopping at the limit returns.
    endless = await refusal(fetch_image(ImageURL.parse(image_host.url("/endless.png")), config))
    assert endless.endswith(": the image is larger than 4096 bytes (the server's limit)")
    with trio.fail_after(5):
        await image_host.client_left.wait()


async def test_a_host_that_stalls_runs_into_the_timeout(
    image_host: ImageHost, authority: trustme.CA
) -> None:
    image_host.routes["/slow.png"] = Reply(stall=True)
    config = test_config(authority, image_host, timeout=0.3)
    started = trio.current_time()
    message = await refusal(fetch_image(ImageURL.parse(image_host.url("/slow.png")), config))
    assert message.endswith(": no complete answer within 0.3 s (the server's image URL timeout)")
    assert trio.current_time() - started < 3
    with trio.fail_after(5):
        await image_host.client_left.wait()  # the connection was closed, not left open


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        (
            Reply(headers=[("Content-Type", "text/html; charset=utf-8")], body=b"<p>hi"),
            "the server sent text/html, not an image/* type",
        ),
        (Reply(headers=[], body=PNG), "the server sent no content type, not an image/* type"),
        (Reply(404, [], b"gone"), "the server answered HTTP 404"),
        (Reply(body=b""), "the server sent no image data"),
    ],
)
async def test_answers_that_are_not_an_image_are_refused(
    image_host: ImageHost, authority: trustme.CA, reply: Reply, reason: str
) -> None:
    image_host.routes["/x"] = reply
    message = await refusal(
        fetch_image(ImageURL.parse(image_host.url("/x")), test_config(authority, image_host))
    )
    assert message.endswith(": " + reason), message


async def test_the_default_policy_refuses_loopback(
    image_host: ImageHost, authority: trustme.CA
) -> None:
    """The production policy (no address_policy given) refuses the test host itself:
    by a name that resolves to 127.0.0.1, and by the 127.0.0.1 literal."""
    image_host.routes["/cat.png"] = Reply()
    by_name = ImageFetchConfig(
        allowed_hosts=frozenset({f"images.test:{image_host.port}"}),
        ssl_context=trusting(authority),
        resolver=loopback_resolver,
    )
    message = await refusal(fetch_image(ImageURL.parse(image_host.url("/cat.png")), by_name))
    assert message.endswith(
        ": 'images.test' resolves to 127.0.0.1, a loopback address, "
        "which this server does not connect to"
    )
    literal = ImageFetchConfig(allowed_hosts=frozenset({f"127.0.0.1:{image_host.port}"}))
    url = ImageURL.parse(image_host.url("/cat.png", name="127.0.0.1"))
    assert "127.0.0.1, a loopback address" in await refusal(fetch_image(url, literal))
    # The system resolver, unfaked: localhost is refused just the same.
    system = ImageFetchConfig(allowed_hosts=frozenset({f"localhost:{image_host.port}"}))
    url = ImageURL.parse(image_host.url("/cat.png", name="localhost"))
    assert "a loopback address" in await refusal(fetch_image(url, system))
    assert image_host.connections == 0


async def test_one_private_address_among_public_ones_refuses_the_host() -> None:
    """Every resolved address is vetted: a name cannot smuggle in an internal one."""

    async def mixed(_name: str, _port: int) -> Sequence[IPAddress]:
        return [ipaddress.ip_address("93.184.215.14"), ipaddress.ip_address("10.1.2.3")]

    config = ImageFetchConfig(allowed_hosts=frozenset({"cdn.example"}), resolver=mixed)
    message = await refusal(fetch_image(ImageURL.parse("https://cdn.example/x.png"), config))
    assert message.endswith(
        ": 'cdn.example' resolves to 10.1.2.3, a private address, "
        "which this server does not connect to"
    )


async def test_the_default_trust_store_does_not_trust_the_test_authority(
    image_host: ImageHost,
) -> None:
    image_host.routes["/cat.png"] = Reply()
    config = ImageFetchConfig(
        allowed_hosts=frozenset({f"images.test:{image_host.port}"}),
        address_policy=allow_loopback,
        resolver=loopback_resolver,
    )
    message = await refusal(fetch_image(ImageURL.parse(image_host.url("/cat.png")), config))
    assert ": TLS certificate check failed: " in message
    assert image_host.requests == []


async def test_cancelling_the_caller_ends_the_fetch_and_its_connection(
    image_host: ImageHost, authority: trustme.CA
) -> None:
    image_host.routes["/slow.png"] = Reply(stall=True)
    config = test_config(authority, image_host, timeout=60)
    url = ImageURL.parse(image_host.url("/slow.png"))
    outcome: list[str] = []

    async def fetch() -> None:
        with trio.CancelScope() as scope:
            cancel_scopes.append(scope)
            await fetch_image(url, config)
        outcome.append("cancelled" if scope.cancelled_caught else "returned")

    cancel_scopes: list[trio.CancelScope] = []
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch)
            await image_host.request_seen.wait()
            cancel_scopes[0].cancel()
        await image_host.client_left.wait()
    assert outcome == ["cancelled"]


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("8.8.8.8", None),
        ("2606:4700:4700::1111", None),
        ("127.0.0.1", "a loopback address"),
        ("::1", "a loopback address"),
        ("0.0.0.0", "an unspecified address"),
        ("10.0.0.1", "a private address"),
        ("192.168.1.1", "a private address"),
        ("fd00::1", "a private address"),
        ("169.254.169.254", "a link-local address"),  # cloud metadata
        ("fe80::1", "a link-local address"),
        ("224.0.0.1", "a multicast address"),
        ("ff02::1", "a multicast address"),
        ("240.0.0.1", "a reserved address"),
        ("100.64.0.1", "a non-public address"),  # carrier-grade NAT
        ("::ffff:127.0.0.1", "a loopback address (inside ::ffff:7f00:1)"),
        ("64:ff9b::a9fe:a9fe", "a link-local address (inside 64:ff9b::a9fe:a9fe)"),
        ("2002:a00:1::", "a private address (inside 2002:a00:1::)"),
    ],
)
def test_public_addresses_only(address: str, reason: str | None) -> None:
    assert public_addresses_only(ipaddress.ip_address(address)) == reason


# ------------------------------------------------------- through a server session

START = {"type": "session.start", "prompt": "a red circle", "size": "64x48", "num_frames": 2}


async def run_session(running: Any, url: str) -> Transcript:
    start = {**START, "image_reference": {"image_url": url}}
    with trio.fail_after(20):
        return await running.run_session(start)


async def test_a_session_gets_the_fetched_image_to_the_engine(
    start_server: Callable[..., Awaitable[Any]], image_host: ImageHost, authority: trustme.CA
) -> None:
    image_host.routes["/cat.png"] = Reply()
    running = await start_server(image_urls=test_config(authority, image_host))
    transcript = await run_session(running, image_host.url("/cat.png"))
    assert transcript.terminal[-1]["type"] == "session.done", transcript.terminal
    config = transcript.of_type("video.start")[0]["config"]
    assert config["image_reference"] == {"image_url": image_host.url("/cat.png")}
    received = running.engine.streams[0].request.image
    assert received is not None and np.array_equal(received, PIXELS)


async def test_a_session_is_refused_an_image_url_by_default(
    start_server: Callable[..., Awaitable[Any]], image_host: ImageHost
) -> None:
    image_host.routes["/cat.png"] = Reply()
    running = await start_server()
    transcript = await run_session(running, image_host.url("/cat.png"))
    assert transcript.types == ["error"]
    error = transcript.messages[0]
    assert error["code"] == "invalid_request"
    assert error["message"] == (
        f"Invalid session.start: image_reference.image_url {image_host.url('/cat.png')!r}: "
        + DISABLED_REASON
    )
    assert transcript.close_code == 1000
    assert running.engine.streams == [] and image_host.connections == 0


async def test_a_fetched_file_that_is_no_image_is_an_invalid_request(
    start_server: Callable[..., Awaitable[Any]], image_host: ImageHost, authority: trustme.CA
) -> None:
    image_host.routes["/fake.png"] = Reply(body=b"not a png at all")
    running = await start_server(image_urls=test_config(authority, image_host))
    transcript = await run_session(running, image_host.url("/fake.png"))
    assert [(e["type"], e["code"]) for e in transcript.json] == [("error", "invalid_request")]
    assert "image_reference" in transcript.messages[0]["message"]
    assert running.engine.streams == []


@pytest.mark.slow
async def test_a_shutdown_during_the_fetch_ends_it_at_once(
    start_server: Callable[..., Awaitable[Any]], image_host: ImageHost, authority: trustme.CA
) -> None:
    image_host.routes["/slow.png"] = Reply(stall=True)
    running = await start_server(image_urls=test_config(authority, image_host, timeout=60))
    transcript = Transcript()
    with trio.fail_after(10):
        async with running.connect() as ws:
            start = {**START, "image_reference": {"image_url": image_host.url("/slow.png")}}
            await ws.send_message(json.dumps(start))
            await image_host.request_seen.wait()
            running.server.shutdown()
            await receive_into(ws, transcript)
        await image_host.client_left.wait()
        await running.wait_sessions_ended(1)
    assert [(e["type"], e["code"]) for e in transcript.json] == [("error", "server_shutdown")]
    assert running.summaries[0].outcome.value == "shutdown"
    assert running.engine.streams == []


async def test_a_client_that_leaves_during_the_fetch_ends_it_at_once(
    start_server: Callable[..., Awaitable[Any]], image_host: ImageHost, authority: trustme.CA
) -> None:
    """The session reads while it prepares: a close ends the fetch, not its timeout."""
    image_host.routes["/slow.png"] = Reply(stall=True)
    running = await start_server(image_urls=test_config(authority, image_host, timeout=60))
    with trio.fail_after(10):
        async with running.connect() as ws:
            start = {**START, "image_reference": {"image_url": image_host.url("/slow.png")}}
            await ws.send_message(json.dumps(start))
            await image_host.request_seen.wait()
        await image_host.client_left.wait()
        await running.wait_sessions_ended(1)
    assert running.summaries[0].outcome.value == "disconnected"
    assert running.engine.streams == []


async def test_messages_sent_while_the_session_prepares_are_answered_after_it(
    start_server: Callable[..., Awaitable[Any]], image_host: ImageHost, authority: trustme.CA
) -> None:
    hold = trio.Event()
    image_host.routes["/late.png"] = Reply(hold=hold)
    running = await start_server(image_urls=test_config(authority, image_host, timeout=60))
    transcript = Transcript()
    with trio.fail_after(20):
        async with running.connect() as ws:
            start = {**START, "image_reference": {"image_url": image_host.url("/late.png")}}
            await ws.send_message(json.dumps(start))
            await image_host.request_seen.wait()
            await ws.send_message(json.dumps({"type": "session.ping"}))
            await ws.send_message(json.dumps({"type": "session.stop"}))
            hold.set()
            await receive_into(ws, transcript)
    types = [m["type"] for m in transcript.json]
    assert types[0] == "video.start" and "session.pong" in types
    assert transcript.terminal[-1]["type"] == "session.done"

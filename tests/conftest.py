"""Shared fixtures: a real server on a loopback port, and a client that records everything;
and the markers that follow from where a test lives or what it asks for."""

from __future__ import annotations

import gc
import io
import json
import os
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import av
import numpy as np
import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url
from xdist.scheduler import LoadFileScheduling

from tests.instrumented import InstrumentedEngine
from tests.player.hlsjs import HLSJS_VERSION, HlsJsUnavailable, hlsjs_script
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.outputs.taps import TapFactory
from trio_vstream.outputs.watch import WatchConfig
from trio_vstream.server.access import AccessPolicy
from trio_vstream.server.app import ServerConfig, VideoServer
from trio_vstream.server.fleet import FleetConfig
from trio_vstream.session.session import SessionConfig, SessionSummary

TESTS = Path(__file__).resolve().parent

FOLDER_MARKERS: dict[str, str] = {"bench": "bench", "player": "browser"}
"""Folders whose every test carries a marker (pyproject.toml lists the markers): the
bench/ tools' tests, and the player page's, which all drive chromium. A test added there
is left out of ``tox -e quick`` without having to remember the marker."""

UNTIMED_BENCH = frozenset(
    {
        "test_fuzz_client",
        "test_fuzz_oracle",
        "test_fuzz_serverlog",
        "test_fuzz_shrinker",
        "test_fuzz_strategies",
        "test_gpu_check",
        "test_ltx2_check",
        "test_reference_server",
        "test_sana_wm_check",
        "test_shapes_card",
        "test_soak_checks",
        "test_soak_held_engine",
        "test_soak_plans",
        "test_soak_resources",
        "test_soak_serverlog",
    }
)
"""The bench/ tools' test modules that time nothing: the fuzz's and the soak's checks fed
made-up records, the GPU check's flags, a tiny pipeline run once. Every other test there,
and every test that drives chromium (``browser``), is ``timed``: it times what it sees (a
figure, a deadline, a page playing in real time), so tox runs it last, one at a time
(tox.ini). A module added to bench/ is ``timed`` until it is named here."""

PIPELINE_FIXTURES = frozenset({"models", "helios", "skyreels", "anyflow_far", "framepack"})
"""The tiny diffusers pipelines (tests/engines/diffusers/conftest.py): building them takes
12 s on a loaded 2-core machine, and a test that runs one takes seconds, so a test that
asks for one is ``slow``, in whichever folder it lives."""


def pytest_itemcollected(item: pytest.Item) -> None:
    """The markers that follow from where a test lives or what it asks for; every other
    marker is written in the test's own module. Set as each test is collected, before
    ``-m`` selects by them."""
    if not item.path.is_relative_to(TESTS):
        return
    folder = item.path.relative_to(TESTS).parts[0]
    if folder in FOLDER_MARKERS:
        item.add_marker(FOLDER_MARKERS[folder])
    browser = item.get_closest_marker("browser") is not None
    if browser and not _in_chromium_lane(item.nodeid):
        raise pytest.UsageError(f"{item.nodeid} drives chromium: add its file to CHROMIUM_LANE")
    if browser or (folder == "bench" and item.path.stem not in UNTIMED_BENCH):
        item.add_marker(pytest.mark.timed)
    if PIPELINE_FIXTURES & set(getattr(item, "fixturenames", ())):
        item.add_marker(pytest.mark.slow)


CHROMIUM_LANE = (
    "tests/player/",
    "tests/security/test_security_headers.py",
    # The bench scenarios that measure in chromium.
    "tests/bench/test_bench_camera_in.py",
    "tests/bench/test_bench_glass.py",
    "tests/bench/test_bench_hls_latency.py",
)
"""Where the tests that drive chromium live (`pytest_itemcollected` refuses a ``browser``
test elsewhere): under ``--dist loadfile`` they are one lane, run one at a time
(`pytest_xdist_make_scheduler`)."""


def _in_chromium_lane(nodeid: str) -> bool:
    return nodeid.startswith(CHROMIUM_LANE)


class _Lanes(LoadFileScheduling):
    """pytest-xdist's ``loadfile`` (each file's tests on one worker, so a bench module's
    run against servers is made once), but for chromium's tests, all in one lane: two
    pages playing in real time at once would each see the other's load."""

    def _split_scope(self, nodeid: str) -> str:
        return "chromium" if _in_chromium_lane(nodeid) else super()._split_scope(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadFileScheduling | None:
    """The ``timed`` tests under ``-n 2 --dist loadfile``, by hand, in two lanes:
    chromium's and the bench tools' (tox runs them one at a time; tox.ini says why);
    xdist's own scheduler for any other ``--dist``."""
    if config.getoption("dist") != "loadfile":
        return None
    return _Lanes(config, log)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under tox the suite runs in three selections (tox.ini); arguments that pick tests
    of only some of them leave the others empty, which is no failure there."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and os.environ.get(
        "TRIO_VSTREAM_SPLIT_RUN"
    ):
        session.exitstatus = pytest.ExitCode.OK


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection loaded (torch, diffusers, every test module), as the CLI
    does once its engine is loaded: a full garbage collection then no longer walks it.
    Walking it took up to half a second on a 2-core machine, a pause of the whole
    process that a test of the stall guard could take for a stalled engine."""
    gc.collect()
    gc.freeze()


CLIENT_MAX_MESSAGE = 64 * 1024 * 1024


def decode_video(data: bytes) -> np.ndarray:
    """What a player shows: the (T, H, W, 3) RGB frames of an MP4 or fMP4 byte string."""
    with av.open(io.BytesIO(data)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return np.stack(frames) if frames else np.zeros((0, 0, 0, 3), np.uint8)


@attrs.define
class Transcript:
    """Everything a client received, in order: dicts for JSON, bytes for binary."""

    messages: list[Any] = attrs.field(factory=list)
    close_code: int | None = None

    @property
    def json(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if isinstance(m, dict)]

    @property
    def types(self) -> list[str]:
        return [m["type"] if isinstance(m, dict) else "<binary>" for m in self.messages]

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.json if m["type"] == kind]

    @property
    def video_bytes(self) -> bytes:
        return b"".join(m for m in self.messages if isinstance(m, bytes))

    @property
    def terminal(self) -> list[dict[str, Any]]:
        return [m for m in self.json if m["type"] in ("session.done", "error")]


async def receive_into(ws: WebSocketConnection, transcript: Transcript) -> None:
    """Read until the server closes; record the close code."""
    try:
        while True:
            raw = await ws.get_message()
            transcript.messages.append(json.loads(raw) if isinstance(raw, str) else raw)
    except ConnectionClosed as exc:
        transcript.close_code = exc.reason.code


async def receive_until(
    ws: WebSocketConnection, transcript: Transcript, predicate: Callable[[Any], bool]
) -> Any:
    """Read (and record) until a message matches."""
    while True:
        raw = await ws.get_message()
        message = json.loads(raw) if isinstance(raw, str) else raw
        transcript.messages.append(message)
        if predicate(message):
            return message


def is_type(kind: str) -> Callable[[Any], bool]:
    return lambda m: isinstance(m, dict) and m.get("type") == kind


@attrs.define
class StopsSeen:
    """When the server's sessions acted on a stop or a disconnect (`record_stops`):
    ``time.monotonic()``, the clock engines' steps are recorded on."""

    times: list[float] = attrs.field(factory=list)
    first: trio.Event = attrs.field(factory=trio.Event)
    """Set once the first stop or disconnect has been acted on."""


def record_stops(monkeypatch: pytest.MonkeyPatch) -> StopsSeen:
    """Record each call of ``Session.stop`` or ``Session.abort`` (passed through): where
    a test of G2 counts the engine's one step from. Counted from the client's send
    instead, an event loop slow to read the message under load lets steps run on before
    the server knows."""
    from trio_vstream.session.session import Session

    seen = StopsSeen()
    for name in ("stop", "abort"):
        real = getattr(Session, name)

        def recording(self: Session, *args: Any, _real: Any = real, **kwargs: Any) -> None:
            seen.times.append(time.monotonic())
            seen.first.set()
            _real(self, *args, **kwargs)

        monkeypatch.setattr(Session, name, recording)
    return seen


@attrs.define
class EndedSessions:
    """What the server's ``on_session_end`` hook saw, and a way to wait for it."""

    summaries: list[SessionSummary] = attrs.field(factory=list)
    checks_at_end: list[dict[str, Any]] = attrs.field(factory=list)
    """The engine's state at the moment each handler finished (G1)."""
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)

    def record(self, summary: SessionSummary, check: dict[str, Any]) -> None:
        self.checks_at_end.append(check)
        self.summaries.append(summary)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, count: int) -> None:
        while len(self.summaries) < count:
            await self._changed.wait()


@attrs.define
class RunningServer:
    server: VideoServer
    engine: InstrumentedEngine
    ended: EndedSessions

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def summaries(self) -> list[SessionSummary]:
        return self.ended.summaries

    @property
    def checks_at_end(self) -> list[dict[str, Any]]:
        return self.ended.checks_at_end

    def connect(self, **kwargs: Any) -> Any:
        kwargs.setdefault("max_message_size", CLIENT_MAX_MESSAGE)
        return open_websocket_url(self.url, **kwargs)

    async def wait_sessions_ended(self, count: int, timeout: float = 10.0) -> None:
        with trio.fail_after(timeout):
            await self.ended.wait_for(count)

    async def run_session(self, start: dict[str, Any], **connect: Any) -> Transcript:
        transcript = Transcript()
        async with self.connect(**connect) as ws:
            await ws.send_message(json.dumps(start))
            await receive_into(ws, transcript)
        return transcript


StartServer = Callable[..., "trio.lowlevel.Task"]


@pytest.fixture
async def start_server(nursery: trio.Nursery) -> Callable[..., Any]:
    """``await start_server(engine_settings..., config=...)`` -> RunningServer on a free port."""

    async def start(
        settings: SyntheticSettings | None = None,
        *,
        max_sessions: int = 8,
        shutdown_grace: float = 5.0,
        encode_concurrency: int = 1,
        engine_class: type[InstrumentedEngine] = InstrumentedEngine,
        access: AccessPolicy | None = None,
        ssl_context: ssl.SSLContext | None = None,
        taps: TapFactory | None = None,
        watch: WatchConfig | None = None,
        fleet: FleetConfig | None = None,
        max_connections: int | None = None,
        max_connections_per_ip: int | None = None,
        head_timeout: float | None = None,
        max_stuck_calls: int | None = None,
        exit_when_wedged: bool = False,
        **session: Any,
    ) -> RunningServer:
        session.setdefault("served_model", "synthetic")
        engine = engine_class(settings or SyntheticSettings())
        ended = EndedSessions()

        def on_end(summary: SessionSummary) -> None:
            # Checked at the very moment the handler finishes: G1.
            ended.record(summary, engine.snapshot(summary.request_id))

        config = ServerConfig(
            host="127.0.0.1",
            port=0,
            max_sessions=max_sessions,
            shutdown_grace=shutdown_grace,
            encode_concurrency=encode_concurrency,
            session=SessionConfig(**session),
            access=access or AccessPolicy(),
            ssl_context=ssl_context,
            watch=watch or WatchConfig(),
            fleet=fleet or FleetConfig(),
            max_connections=max_connections,
            max_connections_per_ip=max_connections_per_ip,
            head_timeout=ServerConfig().head_timeout if head_timeout is None else head_timeout,
            max_stuck_calls=(
                ServerConfig().max_stuck_calls if max_stuck_calls is None else max_stuck_calls
            ),
            exit_when_wedged=exit_when_wedged,
        )
        server = VideoServer(engine, config, on_session_end=on_end, taps=taps)
        await nursery.start(server.run)
        return RunningServer(server, engine, ended)

    return start


@pytest.fixture(scope="session")
def hlsjs() -> bytes:
    """hls.min.js of the release pinned in ``tests/player/hlsjs.py``, for the tests that
    play HLS with it. Not cached and no network: a skip, except in CI (``CI=true``, which
    CI services set), where the tests must run; a tarball other than the pinned one fails
    everywhere."""
    try:
        return hlsjs_script()
    except HlsJsUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs hls.js {HLSJS_VERSION} from the npm registry: {exc}")
        pytest.skip(f"hls.js {HLSJS_VERSION} is not cached and cannot be downloaded: {exc}")

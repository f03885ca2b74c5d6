"""A session's Low-Latency HLS playlist in a real player (issue 33): hls.js, the pinned
release from the npm registry (`tests.player.hlsjs`), plays a live session in Debian's
chromium from its start to its end, presenting (nearly) every frame, with its sound.
(The player page's "Share as HLS", which offers the URL: ``test_player_watch.py``.)

The owner is this process's client (`trio_vstream.client.stream_video`, in a thread of
its own, since Playwright's sync API blocks), its session paced to media time so that it
stays live while it plays. The page is loaded first, and hls.js given the playlist as
soon as the owner has its first chunk. hls.js starts only once a whole segment is listed
(2 s of media by default), and a player joining then at the live edge (PART-HOLD-BACK
behind it) would never show the first second; so the page starts at the stream's start
(``startPosition: 0``) and plays on, live, to the end. Every wait is on state the page
or the owner reports, never a sleep.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from playwright.sync_api import Browser, Page
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from bench.scenarios.hls_latency import stream_shift
from tests.player import hlsjs as hlsjs_module
from tests.player.hlsjs import HLSJS_VERSION, HlsJsMismatch, hlsjs_script, route_page
from tests.player.test_player import (
    CHROMIUM,
    SYNTHETIC,
    WAIT_MS,
    launch_chromium,
    serve,
)
from trio_vstream.client import StreamResult, stream_video
from trio_vstream.outputs.watch import HLS_MARKER

pytestmark = [
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)",
    ),
    pytest.mark.timeout(90),
]

WITH_SOUND = (*SYNTHETIC, "--engine-arg", "audio_tone=440")
FPS = 24
FRAMES = 5 * FPS
"""Five seconds, paced to media time (``pace_to_media_time``): live for as long as it
plays, so hls.js joins a live playlist and plays it out to its end."""
PRESENTED_SHARE = 0.99
"""The issue's bar: at least this share of the session's frames presented."""


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(tmp_path_factory.mktemp("player-hls") / "server.log", engine=WITH_SOUND) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with launch_chromium() as browser:
        yield browser


class Owner:
    """A session run by this process's client in a thread of its own (its own Trio
    loop): what the test waits on is set as the messages arrive."""

    def __init__(self, url: str, fields: dict[str, Any]) -> None:
        self.url, self.fields = url, fields
        self.hls_path: str | None = None
        self.first_chunk = threading.Event()
        self.result: StreamResult | None = None
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hls-owner", daemon=True)

    def _run(self) -> None:
        def on_chunk(_chunk: object, result: StreamResult) -> None:
            if result.video_start is not None:
                self.hls_path = result.video_start.hls_path
            self.first_chunk.set()

        try:
            self.result = trio.run(lambda: stream_video(self.url, self.fields, on_chunk=on_chunk))
        except BaseException as exc:
            self.failure = exc
        finally:
            self.first_chunk.set()  # never leave the test waiting

    def __enter__(self) -> Owner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(timeout=WAIT_MS / 1000)
        assert not self._thread.is_alive(), "the owner's session did not end"
        if self.failure is not None:
            raise self.failure


@contextlib.contextmanager
def hls_page(browser: Browser, origin: str, script: bytes) -> Iterator[Page]:
    """The hls.js test page at ``origin``; fails the test on a JavaScript error."""
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    script_errors: list[str] = []
    page.on("pageerror", lambda error: script_errors.append(str(error)))
    try:
        page.goto(route_page(page, origin, script))
        yield page
    finally:
        context.close()
    assert script_errors == [], script_errors


def test_hlsjs_plays_a_live_session_to_its_end_with_every_frame_and_the_sound(
    browser: Browser, base_url: str, hlsjs: bytes
) -> None:
    fields = {
        "prompt": "a red circle",
        "size": "128x96",
        "fps": FPS,
        "num_frames": FRAMES,
        "extra_params": {"pace_to_media_time": True, "pacing_lead_seconds": 0},
    }
    ws_url = base_url.replace("http://", "ws://") + "/v1/realtime/video"
    with hls_page(browser, base_url, hlsjs) as page, Owner(ws_url, fields) as owner:
        assert owner.first_chunk.wait(WAIT_MS / 1000), "no chunk came"
        hls_path = owner.hls_path
        assert hls_path is not None, owner.failure
        assert hls_path.endswith(f"{HLS_MARKER}index.m3u8")
        # From the stream's start, not the live edge (see the module's docstring).
        version = page.evaluate(
            "([url, config]) => playHls(url, config)",
            [base_url + hls_path, {"startPosition": 0}],
        )
        assert version == HLSJS_VERSION
        try:
            page.wait_for_function(
                "() => window.hlsRun.ended || window.hlsRun.fatal != null", timeout=WAIT_MS
            )
        except PlaywrightTimeoutError:
            stuck = page.evaluate("() => window.hlsRun")
            pytest.fail(
                f"hls.js did not play to the end: {len(stuck['frames'])} frames presented, "
                f"the last at {stuck['frames'][-1][0] if stuck['frames'] else None} s; "
                f"errors {sorted(set(stuck['errors']))}"
            )
        run = page.evaluate("() => window.hlsRun")
    assert owner.result is not None and owner.result.done is not None
    sent = sum(chunk.num_frames for chunk in owner.result.chunks)
    assert sent == FRAMES

    assert run["fatal"] is None, run["errors"]
    assert run["ended"]
    assert run["live"] is True, "hls.js joined after the session ended: not a live test"
    frames = run["frames"]
    assert frames, "no frame presented"
    # The element's running count (presentedFrames): a frame presented between two
    # callbacks counts too.
    presented = frames[-1][1]
    assert presented >= PRESENTED_SHARE * sent, (presented, sent, run["quality"])
    assert presented <= sent + 1, presented
    # From the first frame to the last, on the stream's timeline.
    assert len(run["initPts"]) >= 1
    stream_times = [media + stream_shift(media, run["initPts"]) for media, _, _ in frames]
    assert stream_times[0] == pytest.approx(0.0, abs=0.5 / FPS)
    assert stream_times[-1] == pytest.approx((sent - 1) / FPS, abs=0.5 / FPS)
    # The sound: hls.js buffered the AAC track, and chromium decoded it.
    codecs = run["codecs"]
    assert "mp4a.40.2" in codecs and any(c.startswith("avc1.") for c in codecs), codecs
    assert run["audioBytes"] > 0


def test_hlsjs_comes_from_the_cache_or_the_registry_and_only_as_pinned(
    hlsjs: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cached = hlsjs_module.cache_dir() / f"hls.js-{HLSJS_VERSION}.tgz"
    downloads: list[str] = []

    def download(url: str, timeout: float) -> bytes:
        downloads.append(url)
        return served

    monkeypatch.setattr(hlsjs_module, "_download", download)
    # A good copy in the cache: no download.
    (tmp_path / cached.name).write_bytes(cached.read_bytes())
    served = b"not this"
    assert hlsjs_script(tmp_path) == hlsjs
    assert downloads == []
    # A damaged copy is fetched again; other bytes than the pinned ones fail.
    (tmp_path / cached.name).write_bytes(b"damaged")
    with pytest.raises(HlsJsMismatch, match="integrity"):
        hlsjs_script(tmp_path)
    assert downloads == [hlsjs_module.HLSJS_TARBALL]
    served = cached.read_bytes()
    assert hlsjs_script(tmp_path) == hlsjs
    assert (tmp_path / cached.name).read_bytes() == served


def test_the_test_page_is_not_in_the_package() -> None:
    package = Path(__file__).resolve().parents[2] / "trio_vstream"
    assert not [p for p in package.rglob("*") if "hls.js" in p.name or p.name == "hls.min.js"]
    assert b"hls.js" not in (package / "static" / "player.js").read_bytes()

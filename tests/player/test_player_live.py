"""The player page's Live mode (issue 22), in a real browser (see ``tests/player/test_player.py``):
it opts into vllm-omni's playback-paced generation (``streaming_buffer_seconds``), reports
the playhead it presents (``session.playback``), starts playing below the window, shows
underruns, and a live session runs until stopped. Every wait is on state the page shows.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.player.test_player import (
    CHROMIUM,
    CHUNK_FRAMES,
    launch_chromium,
    open_player,
    serve,
    start,
    wait_playing,
)
from trio_vstream.protocol import DEFAULT_LIMITS

pytestmark = [
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)",
    ),
    pytest.mark.timeout(120),
]

FPS = 24
SLOW = (
    "--engine",
    "synthetic",
    "--engine-arg",
    "step_delay=0.15",
    "--engine-arg",
    f"chunk_frames={CHUNK_FRAMES}",
)
"""A synthetic engine slower than real time: 4 steps of 0.15 s make a third of a second
of video in 0.6 s, so a live player runs dry between chunks."""


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(tmp_path_factory.mktemp("player-live") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def slow_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(tmp_path_factory.mktemp("player-slow") / "server.log", engine=SLOW) as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with launch_chromium() as browser:
        yield browser


@pytest.fixture
def page(browser: Browser, base_url: str) -> Iterator[Page]:
    with open_player(browser, base_url) as page:
        yield page


def traffic(page: Page) -> list[tuple[str, dict[str, Any]]]:
    """The page's WebSocket messages from now on, both ways, in order: ("sent", message)
    and ("received", message) for text; binary media arrives as ("received", {}).
    """
    log: list[tuple[str, dict[str, Any]]] = []

    def on_socket(socket: Any) -> None:
        def on_sent(payload: str | bytes) -> None:
            if isinstance(payload, str):
                log.append(("sent", json.loads(payload)))

        def on_received(payload: str | bytes) -> None:
            log.append(("received", json.loads(payload) if isinstance(payload, str) else {}))

        socket.on("framesent", on_sent)
        socket.on("framereceived", on_received)

    page.on("websocket", on_socket)
    return log


def constants(page: Page) -> dict[str, float]:
    return page.evaluate(
        """async () => {
            const player = await import("/static/player.js");
            return {buffer: player.LIVE.bufferSeconds, start: player.LIVE.startSeconds};
        }"""
    )


def reports_checked(log: list[tuple[str, dict[str, Any]]]) -> list[float]:
    """The positions the page reported, each checked against what it had received
    when it sent it: finite, not negative, moving forward, never past the media that
    had arrived (a playhead is never advanced to hide a stall)."""
    positions: list[float] = []
    media_s = 0.0
    for direction, message in log:
        if direction == "received" and message.get("type") == "video.chunk_metadata":
            if message["kind"] == "media":
                media_s += message["num_frames"] / FPS
        elif direction == "sent" and message["type"] == "session.playback":
            assert message.keys() == {"type", "position_seconds"}
            position = message["position_seconds"]
            assert isinstance(position, int | float) and math.isfinite(position)
            assert 0 <= position <= media_s + 1e-6, (position, media_s)
            assert not positions or position > positions[-1], (positions[-1], position)
            positions.append(position)
    return positions


def test_live_paces_generation_by_the_playhead_it_reports(page: Page) -> None:
    knobs = constants(page)
    # Even from any slack at all, after 2 chunks.
    page.evaluate(
        """async () => Object.assign((await import("/static/player.js")).LIVE,
                                     {slackSeconds: 0, slackChunks: 2})"""
    )
    # Playback starts with less than the window buffered: the server holds back what
    # lies beyond it until the page plays, so a threshold at or above it never starts.
    assert 0 < knobs["start"] < knobs["buffer"]
    log = traffic(page)
    start(page, seconds=4)
    wait_playing(page, 2.0)
    expect(page.locator("#fig-buffered")).to_contain_text(f"window {knobs['buffer']:g} s")
    expect(page.locator("#status")).to_contain_text("session.done")

    first = next(message for direction, message in log if direction == "sent")
    assert first["type"] == "session.start"
    assert first["streaming_buffer_seconds"] == knobs["buffer"]
    assert first["extra_params"] == {"pace_to_media_time": True}
    positions = reports_checked(log)
    # About every 100 ms over 2 s of playing and more (a loaded machine drops some).
    assert len(positions) >= 8, positions
    assert positions[-1] >= 2.0
    # Nothing after the session ended.
    done = max(i for i, (_, m) in enumerate(log) if m.get("type") == "session.done")
    assert not [m for d, m in log[done:] if d == "sent" and m["type"] == "session.playback"]
    figure = page.locator("#fig-underruns")
    expect(figure).to_have_attribute("data-count", "0")
    # A prompt-only engine's stream is paced by the playhead alone: playing faster would
    # only play it faster, so the page never catches up (the shapes test shows it does).
    stats = page.evaluate('async () => (await import("/static/player.js")).liveStats()')
    assert stats["catchUps"] == 0 and stats["playbackRate"] == 1
    expect(page.locator("#errors")).to_be_empty()


def test_live_off_keeps_unpaced_generation(page: Page) -> None:
    log = traffic(page)
    page.uncheck("#live")
    start(page, seconds=2)
    expect(page.locator("#status")).to_contain_text("session.done")
    sent = [message for direction, message in log if direction == "sent"]
    assert sent[0]["type"] == "session.start"
    assert "streaming_buffer_seconds" not in sent[0]
    assert "extra_params" not in sent[0]
    assert [m["type"] for m in sent] == ["session.start"]  # no playhead reports
    expect(page.locator("#errors")).to_be_empty()


def test_a_live_session_runs_until_stopped_by_default(page: Page) -> None:
    # Live is on: the length is the server's most frames, not the engine's 2 s clip.
    expect(page.locator("#live")).to_be_checked()
    most = DEFAULT_LIMITS.max_num_frames
    expect(page.locator("#length-unit")).to_have_value("seconds")
    expect(page.locator("#length")).to_have_value(str(most // FPS))
    page.uncheck("#live")
    expect(page.locator("#length")).to_have_value("2")  # the synthetic engine's 48 frames
    page.check("#live")
    expect(page.locator("#length")).to_have_value(str(most // FPS))
    # A length the user typed stays whatever Live is.
    page.fill("#length", "7")
    page.uncheck("#live")
    expect(page.locator("#length")).to_have_value("7")


def test_a_stream_slower_than_real_time_shows_underruns_and_an_honest_playhead(
    browser: Browser, slow_url: str
) -> None:
    with open_player(browser, slow_url) as page:
        log = traffic(page)
        start(page, seconds=30)
        figure = page.locator("#fig-underruns")
        page.wait_for_function(
            "() => Number(document.getElementById('fig-underruns').dataset.count) >= 2"
        )
        page.click("#stop")
        expect(page.locator("#status")).to_contain_text("session.done")
        assert float(figure.get_attribute("data-ms") or "nan") > 0
        expect(figure).to_have_text(re.compile(r"^\d+ \(\d+ ms\)$"))
        positions = reports_checked(log)
        assert positions, "no playhead reported"

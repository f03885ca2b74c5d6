"""The player page at ``GET /``, in a real browser: Debian's chromium driven by Playwright.

The server runs as a subprocess (``python -m trio_vstream --port 0``) and the tests are
plain sync tests: Playwright's sync API blocks, so it must not run on a Trio event loop.
Every wait is on state the page shows (the status line, the figures, the video's
``currentTime``), never a sleep. Every ``wait_for_function`` is given an arrow function:
Playwright polls a bare expression with ``eval``, which the page's Content-Security-Policy
forbids (tests/security/test_security_headers.py). CI installs chromium from Debian (see
``.ci/run``); the browser is never downloaded (no ``playwright install``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.conftest import decode_video
from trio_vstream.engines.synthetic import SyntheticEngine, prompt_colour

CHROMIUM = Path("/usr/bin/chromium")
CHUNK_FRAMES = 8
# 4 steps of 0.02 s make an 8-frame chunk (1/3 s at 24 fps) in 0.08 s, about 4x real
# time: with "Live" on the server paces the chunks to media time, with it off a long
# video arrives quickly (for the buffer-trimming test).
STEP_DELAY = 0.02
WAIT_MS = 30_000
API_KEY = "player-key-5e2b"
"""The key of the second server, started with ``--api-key``."""

pytestmark = [
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)",
    ),
    pytest.mark.timeout(120),
]


SYNTHETIC = (
    "--engine",
    "synthetic",
    "--engine-arg",
    f"step_delay={STEP_DELAY}",
    "--engine-arg",
    f"chunk_frames={CHUNK_FRAMES}",
)
"""The engine flags of `serve`'s server unless a test names others."""


@contextlib.contextmanager
def serve(log: Path, *extra: str, engine: Sequence[str] = SYNTHETIC) -> Iterator[str]:
    """A server (the synthetic engine unless ``engine`` names another) on a free port;
    yields ``http://host:port``."""
    command = [
        sys.executable,
        "-m",
        "trio_vstream",
        "--port",
        "0",
        *engine,
        "--log-level",
        "WARNING",
        *extra,
    ]
    # Keys come from ``extra`` only, not from a TRIO_VSTREAM_API_KEY the shell may export.
    env = {k: v for k, v in os.environ.items() if k != "TRIO_VSTREAM_API_KEY"}
    with log.open("w") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "trio_vstream serving ws://127.0.0.1:PORT/..."
        found = re.search(r"ws://([^/\s]+)/", line)
        assert found, f"server did not start: {line!r}\n{log.read_text()}"
        yield f"http://{found.group(1)}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(tmp_path_factory.mktemp("player") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def keyed_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second server that needs ``API_KEY``: started only if a test asks for it."""
    log = tmp_path_factory.mktemp("player-keyed") / "server.log"
    with serve(log, "--api-key", API_KEY) as url:
        yield url


@contextlib.contextmanager
def launch_chromium() -> Iterator[Browser]:
    """Debian's chromium, headless, through Playwright."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            # Containers (CI runs as root) have no user namespaces for the sandbox.
            args=["--no-sandbox", "--autoplay-policy=no-user-gesture-required"],
        )
        yield browser
        browser.close()


@contextlib.contextmanager
def open_player(browser: Browser, url: str) -> Iterator[Page]:
    """The player at ``url``, loaded, with the server's defaults in the form; fails the
    test if the page raised a JavaScript error meanwhile."""
    context = browser.new_context(viewport={"width": 1000, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    script_errors: list[str] = []
    page.on("pageerror", lambda error: script_errors.append(str(error)))
    try:
        page.goto(f"{url}/")
        page.wait_for_function("() => document.body.dataset.ready === 'true'")
        yield page
    finally:
        context.close()
    assert script_errors == [], "the page raised JavaScript errors"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with launch_chromium() as browser:
        yield browser


@pytest.fixture
def page(browser: Browser, base_url: str) -> Iterator[Page]:
    """The player, loaded, with the server's defaults in the form."""
    with open_player(browser, base_url) as page:
        yield page


def sent_messages(page: Page) -> list[dict[str, Any]]:
    """Collects the JSON messages the page sends on its WebSockets, from now on."""
    sent: list[dict[str, Any]] = []

    def on_socket(socket: Any) -> None:
        def on_frame(payload: str | bytes) -> None:
            if isinstance(payload, str):
                sent.append(json.loads(payload))

        socket.on("framesent", on_frame)

    page.on("websocket", on_socket)
    return sent


def start(page: Page, seconds: int) -> None:
    page.fill("#length", str(seconds))
    page.select_option("#length-unit", "seconds")
    page.click("#start")


def wait_playing(page: Page, seconds: float) -> None:
    page.wait_for_function(
        "t => document.getElementById('video').currentTime >= t", arg=seconds, timeout=WAIT_MS
    )


def mean_rgb(page: Page) -> np.ndarray:
    """The mean colour of the frame on screen, read back through a canvas."""
    rgb = page.evaluate(
        """() => {
            const video = document.getElementById("video");
            const canvas = document.createElement("canvas");
            canvas.width = canvas.height = 32;
            const context = canvas.getContext("2d", { willReadFrequently: true });
            context.drawImage(video, 0, 0, 32, 32);
            const pixels = context.getImageData(0, 0, 32, 32).data;
            const sum = [0, 0, 0];
            for (let i = 0; i < pixels.length; i += 4) {
                for (let c = 0; c < 3; c++) sum[c] += pixels[i + c];
            }
            return sum.map((s) => s / (pixels.length / 4));
        }"""
    )
    return np.array(rgb, dtype=np.float64)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-9))


def test_plays_live_with_the_engines_defaults(page: Page) -> None:
    defaults = SyntheticEngine.video_defaults
    # Filled from /v1/models, not written in the page.
    expect(page.locator("#size")).to_have_value(f"{defaults.width}x{defaults.height}")
    expect(page.locator("#fps")).to_have_value(str(defaults.fps))
    expect(page.locator("#model-info")).to_contain_text("synthetic")
    sent = sent_messages(page)

    start(page, seconds=3)
    wait_playing(page, 1.0)

    first = sent[0]
    assert first["type"] == "session.start"
    assert first["model"] == "synthetic"
    assert first["seconds"] == "3"
    assert first["extra_params"] == {"pace_to_media_time": True}  # "Live" is on
    # Empty fields are left to the engine.
    assert not {"seed", "num_inference_steps", "guidance_scale"} & first.keys()
    expect(page.locator("#fig-seed")).to_have_text("0")  # the seed the engine used
    expect(page.locator("#fig-codec")).to_have_text(re.compile(r"avc1\.[0-9A-F]{6}"))
    expect(page.locator("#status")).to_contain_text("session.done", timeout=WAIT_MS)
    expect(page.locator("#fig-chunks")).to_have_text(str(3 * defaults.fps // CHUNK_FRAMES))
    expect(page.locator("#errors")).to_be_empty()


def test_an_interaction_changes_the_colour(page: Page) -> None:
    before = "a red circle"
    candidates = ["a blue square", "a green triangle", "a purple star", "a yellow moon"]
    # The synthetic engine's colour is a hash of the prompt: take the most different one.
    after = min(candidates, key=lambda p: cosine(prompt_colour(before), prompt_colour(p)))
    page.fill("#prompt", before)

    start(page, seconds=10)
    wait_playing(page, 0.5)
    colour_before = mean_rgb(page)
    page.fill("#interact-prompt", after)
    page.fill("#transition", "0")
    page.click("#send")

    event = page.locator('#timeline li[data-event-id="interaction-1"]')
    expect(event).to_have_attribute("data-state", "completed", timeout=WAIT_MS)
    switch_at = float(event.get_attribute("data-start-time") or "nan")
    wait_playing(page, switch_at + 0.3)
    colour_after = mean_rgb(page)
    page.click("#stop")

    old, new = prompt_colour(before), prompt_colour(after)
    assert cosine(colour_before, old) > cosine(colour_before, new), colour_before
    assert cosine(colour_after, new) > cosine(colour_after, old), colour_after
    assert np.abs(colour_after - colour_before).max() > 40
    expect(page.locator("#status")).to_contain_text("session.done", timeout=WAIT_MS)


def test_stop_ends_with_session_done_and_save_keeps_what_arrived(
    page: Page, tmp_path: Path
) -> None:
    start(page, seconds=30)
    page.wait_for_function("() => Number(document.getElementById('fig-chunks').textContent) >= 2")
    page.click("#stop")

    status = page.locator("#status")
    expect(status).to_contain_text("session.done")
    expect(status).to_contain_text("stopped")
    expect(status).to_contain_text("Socket closed")
    expect(page.locator("#start")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()

    with page.expect_download() as download:
        page.click("#save")
    path = tmp_path / "saved.mp4"
    download.value.save_as(path)
    assert download.value.suggested_filename.endswith(".mp4")
    chunks = int(page.locator("#fig-chunks").text_content() or "0")
    assert decode_video(path.read_bytes()).shape[0] == chunks * CHUNK_FRAMES


def test_the_buffer_is_trimmed_behind_the_playhead(page: Page) -> None:
    # "Live" off: chunks come as fast as they are made, and nothing is skipped.
    page.uncheck("#live")
    page.fill("#size", "128x128")
    start(page, seconds=24)
    wait_playing(page, 0.1)
    # Fast-forward through the video instead of waiting 20 s for it.
    page.evaluate("document.getElementById('video').playbackRate = 8")
    wait_playing(page, 18.0)
    playhead, kept_from = page.evaluate(
        """() => {
            const video = document.getElementById("video");
            return [video.currentTime, video.buffered.start(0)];
        }"""
    )
    # The page keeps at most 10 s behind the playhead (then trims to 4 s); it checks on
    # every timeupdate, 4 times a second, when at 8x the playhead moves 2 s.
    assert kept_from > 0, "nothing was trimmed"
    assert playhead - kept_from <= 12.5, (playhead, kept_from)
    page.wait_for_function("() => document.getElementById('video').ended")
    expect(page.locator("#status")).to_contain_text("session.done")
    expect(page.locator("#errors")).to_be_empty()


def test_a_bad_size_shows_the_servers_invalid_request(page: Page) -> None:
    page.fill("#size", "257x256")
    # Enter in the prompt starts, like the Start button.
    page.focus("#prompt")
    page.keyboard.press("Enter")

    errors = page.locator("#errors")
    expect(errors).to_contain_text("invalid_request")
    expect(errors).to_contain_text("width must be even")
    expect(page.locator("#status")).to_contain_text("Socket closed")
    expect(page.locator("#fig-chunks")).to_have_text("0")


def test_a_server_with_an_api_key_asks_for_it_and_plays_with_it(
    browser: Browser, keyed_url: str
) -> None:
    context = browser.new_context(viewport={"width": 1000, "height": 900})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    script_errors: list[str] = []
    page.on("pageerror", lambda error: script_errors.append(str(error)))
    page.goto(f"{keyed_url}/")

    # /v1/models answered 401: the page asks, with a labelled field and a note.
    field = page.get_by_role("textbox", name="API key")
    expect(field).to_be_visible()
    expect(field).to_have_attribute("type", "password")
    expect(field).to_be_focused()
    expect(field).to_have_accessible_description(re.compile("needs an API key"))
    expect(page.locator("#start")).to_be_disabled()

    field.fill("not-the-key")
    field.press("Enter")
    refusal = page.locator("#key-error")
    expect(refusal).to_contain_text("The server refused the key")
    expect(field).to_have_attribute("aria-invalid", "true")
    assert page.evaluate("sessionStorage.length") == 0  # a refused key is not kept

    field.fill(API_KEY)
    field.press("Enter")
    defaults = SyntheticEngine.video_defaults
    expect(page.locator("#size")).to_have_value(f"{defaults.width}x{defaults.height}")
    expect(page.locator("#model-info")).to_contain_text("synthetic")
    expect(page.locator("#key-form")).to_be_hidden()
    expect(refusal).to_be_empty()
    stored = page.evaluate("[sessionStorage.length, localStorage.length]")
    assert stored == [1, 0], stored  # this tab only

    start(page, seconds=10)
    wait_playing(page, 0.5)  # the WebSocket got in: the key went as a subprotocol entry
    page.click("#stop")
    expect(page.locator("#status")).to_contain_text("session.done")
    expect(page.locator("#errors")).to_be_empty()

    # A reload in the same tab does not ask again.
    page.reload()
    page.wait_for_function("() => document.body.dataset.ready === 'true'")
    expect(page.locator("#model-info")).to_contain_text("synthetic")
    expect(page.locator("#key-form")).to_be_hidden()

    # A key that stops working after the page loaded (revoked, say): the WebSocket is
    # refused at the handshake, whose 401 browsers do not show the page.
    page.evaluate("key => sessionStorage.setItem(sessionStorage.key(0), key)", "revoked")
    start(page, seconds=2)
    expect(page.locator("#errors")).to_contain_text(
        "the server refused the connection (check the API key)"
    )
    expect(page.locator("#start")).to_be_enabled()

    page.click("#key-forget")
    expect(field).to_be_visible()
    expect(refusal).to_be_empty()
    assert page.evaluate("sessionStorage.length") == 0
    context.close()
    assert script_errors == [], "the page raised JavaScript errors"

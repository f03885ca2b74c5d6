"""Camera in (issue 34), in a real browser: the page sends chromium's fake camera (a Y4M
loop of a green blob going round, `tests.player.fake_camera`) as the session's input
video, and the output follows it.

What each frame the page sent showed is read where it was drawn: an init script wraps
``HTMLCanvasElement.toBlob`` (test code, not the page's) to find the blob on the canvas
before the JPEG is made. What the output showed is the saved video, decoded here; the
chunks' ``input_frames`` say which input frame each output frame was made from.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.conftest import decode_video
from tests.player import fake_camera
from tests.player.test_player import CHROMIUM, open_player, serve

pytestmark = [
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)",
    ),
    pytest.mark.timeout(120),
]

ECHO = ("--engine", "tests.instrumented:create_echo_engine", "--engine-arg", "chunk_frames=8")
"""An engine that shows its input exactly: what the page sent is what comes back."""

SENT_CENTROIDS = """
(() => {
  // Test code: where the blob is in each frame the page sends, in the order sent.
  window.__sent = [];
  const toBlob = HTMLCanvasElement.prototype.toBlob;
  HTMLCanvasElement.prototype.toBlob = function (callback, ...rest) {
    const { width, height } = this;
    const pixels = this.getContext("2d").getImageData(0, 0, width, height).data;
    let x = 0, y = 0, n = 0;
    for (let i = 0; i < pixels.length; i += 4) {
      if (pixels[i + 1] - Math.max(pixels[i], pixels[i + 2]) > 60) {
        const p = i / 4;
        x += p % width; y += Math.floor(p / width); n += 1;
      }
    }
    const centre = n >= 20 ? [x / n, y / n] : null;
    return toBlob.call(this, (blob) => {
      if (blob) centres.set(blob, centre);
      callback(blob);
    }, ...rest);
  };
  // Counted when sent, not when encoded: the page drops an encode that finishes after
  // its session stopped.
  const centres = new WeakMap();
  const send = WebSocket.prototype.send;
  WebSocket.prototype.send = function (data) {
    if (centres.has(data)) window.__sent.push(centres.get(data));
    return send.call(this, data);
  };
})();
"""


@pytest.fixture(scope="module")
def camera_browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    """Chromium whose camera is the Y4M loop, granted without asking."""
    y4m = fake_camera.write_y4m(tmp_path_factory.mktemp("camera") / "blob.y4m")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            headless=True,
            args=[
                "--no-sandbox",
                "--autoplay-policy=no-user-gesture-required",
                "--use-fake-device-for-media-stream",
                "--use-fake-ui-for-media-stream",
                f"--use-file-for-fake-video-capture={y4m}",
            ],
        )
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def echo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(tmp_path_factory.mktemp("camera-echo") / "server.log", engine=ECHO) as url:
        yield url


def chunk_log(page: Page) -> list[dict[str, Any]]:
    """The media chunks' metadata, as the page receives them."""
    log: list[dict[str, Any]] = []

    def on_socket(socket: Any) -> None:
        def on_received(payload: str | bytes) -> None:
            if isinstance(payload, str):
                message = json.loads(payload)
                if message.get("type") == "video.chunk_metadata" and message["kind"] == "media":
                    log.append(message)

        socket.on("framereceived", on_received)

    page.on("websocket", on_socket)
    return log


def run_camera_session(page: Page, tmp_path: Path, chunks: int) -> tuple[np.ndarray, list[Any]]:
    """Start with Camera in, stop after ``chunks`` chunks; the saved video's frames and
    the chunks' metadata."""
    log = chunk_log(page)
    expect(page.locator("#camera-in-row")).to_be_visible()
    page.check("#camera-in")
    page.fill("#size", "256x256")
    page.fill("#fps", "12")
    page.click("#start")
    expect(page.locator("#camera-view")).to_be_visible()
    page.wait_for_function(
        "n => Number(document.getElementById('fig-chunks').textContent) >= n", arg=chunks
    )
    # And the page has seen a few of them on screen: its camera-to-frame figure.
    page.wait_for_function(
        "() => Number(document.getElementById('fig-camera-p50').dataset.count ?? 0) >= 3"
    )
    page.click("#stop")
    expect(page.locator("#status")).to_contain_text("session.done")
    expect(page.locator("#camera-view")).to_be_hidden()  # the camera is let go
    with page.expect_download() as download:
        page.click("#save")
    path = tmp_path / "saved.mp4"
    download.value.save_as(path)
    return decode_video(path.read_bytes()), log


def input_index_of_each_frame(log: list[dict[str, Any]]) -> list[int | None]:
    """For each output frame, the input frame it was made from (its chunk's window
    spread evenly from ``first`` to ``last``; None before any input)."""
    indices: list[int | None] = []
    for message in log:
        counts = message["input_frames"]
        n = message["num_frames"]
        if counts["last"] is None:
            indices += [None] * n
            continue
        first = counts["first"] if counts["first"] is not None else counts["last"]
        indices += [round(v) for v in np.linspace(first, counts["last"], n)]
    return indices


def tracking(frames: np.ndarray, log: list[Any], sent: list[Any], follow: Any) -> np.ndarray:
    """Pairs of (input blob centre, output centre) per output frame, x then y."""
    pairs = []
    for frame, index in zip(frames, input_index_of_each_frame(log), strict=False):
        if index is None or index >= len(sent) or sent[index] is None:
            continue
        seen = follow(frame)
        if seen is not None:
            pairs.append((*sent[index], *seen))
    return np.array(pairs)


def test_the_page_sends_its_camera_and_the_output_is_made_from_it(
    camera_browser: Browser, echo_url: str, tmp_path: Path
) -> None:
    with open_player(camera_browser, echo_url) as page:
        page.add_init_script(SENT_CENTROIDS)
        page.reload()
        page.wait_for_function("() => document.body.dataset.ready === 'true'")
        frames, log = run_camera_session(page, tmp_path, chunks=6)
        sent = page.evaluate("() => window.__sent")
        stats = page.evaluate('async () => (await import("/static/player.js")).liveStats()')
    camera = stats["cameraIn"]
    assert camera["sent"] == len(sent) > 0
    used = sum(m["input_frames"]["used"] for m in log)
    assert used > 0 and camera["counts"]["used"] == used
    assert all(m["input_frames"]["dropped"] == 0 for m in log)  # paced to the chunks
    # An engine that suggests no chunk for live camera sessions gets its own (8 frames).
    assert {m["num_frames"] for m in log} == {8}
    pairs = tracking(frames, log, sent, fake_camera.green_centroid)
    assert len(pairs) >= 24
    for axis in (0, 1):
        correlation = np.corrcoef(pairs[:, axis], pairs[:, axis + 2])[0, 1]
        assert correlation >= 0.9, (axis, correlation)
    # The page measured its camera-to-frame delay for the chunks it showed.
    assert len(camera["latencies"]) >= 3
    assert all(ms > 0 for ms in camera["latencies"])
    assert all(len(part) == 2 for part in camera["parts"])


SHAPES = ("--engine", "shapes", "--device", "cpu", "--engine-arg", "threads=1")


@pytest.fixture(scope="module")
def shapes_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(tmp_path_factory.mktemp("camera-shapes") / "server.log", engine=SHAPES) as url:
        yield url


def red_centroid(picture: np.ndarray) -> tuple[float, float] | None:
    """The centre (x, y) of the red object the prompt asks for."""
    rgb = picture.astype(np.int32)
    mask = (rgb[..., 0] - np.maximum(rgb[..., 1], rgb[..., 2])) > 60
    if mask.sum() < 20:
        return None
    rows, cols = np.nonzero(mask)
    return float(cols.mean()), float(rows.mean())


def test_the_built_in_model_follows_the_camera(
    camera_browser: Browser, shapes_url: str, tmp_path: Path
) -> None:
    """The page's default engine: its red circle goes where the camera's green blob is."""
    with open_player(camera_browser, shapes_url) as page:
        page.add_init_script(SENT_CENTROIDS)
        page.reload()
        page.wait_for_function("() => document.body.dataset.ready === 'true'")
        page.fill("#prompt", "a red circle on a navy background")
        frames, log = run_camera_session(page, tmp_path, chunks=16)
        sent = page.evaluate("() => window.__sent")
    # Live mode asks for the engine's live_input_chunk_frames: half its 8-frame chunk.
    assert {m["num_frames"] for m in log} == {4}
    pairs = tracking(frames, log, sent, red_centroid)
    assert len(pairs) >= 32
    for axis in (0, 1):
        correlation = np.corrcoef(pairs[:, axis], pairs[:, axis + 2])[0, 1]
        assert correlation >= 0.9, (axis, correlation)

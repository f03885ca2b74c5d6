"""The player page's camera controls, in a real browser (see ``tests/player/test_player.py``).

The ``shapes`` engine takes camera velocities (its ``/v1/models`` entry lists
``"camera"``) and steers its object by them; the synthetic engine takes prompts only.
The pages stream "Live" (paced to media time), so keys land mid-video however fast
the engine is. Every wait is on state the page shows, never a sleep.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect

from tests.conftest import decode_video
from tests.player.test_player import (
    CHROMIUM,
    launch_chromium,
    open_player,
    sent_messages,
    serve,
    wait_playing,
)
from trio_vstream.models.shapes import evaluate

pytestmark = [
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)",
    ),
    pytest.mark.timeout(120),
]

FPS = 24
STEP = 0.05


def turn(axis: tuple[float, float, float], degrees: float) -> list[float]:
    """A unit quaternion [qx, qy, qz, qw] turning ``degrees`` about ``axis``."""
    half = math.radians(degrees) / 2
    return [*(a * math.sin(half) for a in axis), math.cos(half)]


STILL = [0.0, 0.0, 0.0, 1.0]
NO_MOVE = [0.0, 0.0, 0.0]
# The page's mapping, in Unity's axes (+X right, +Y up, +Z forward) with turns in
# vllm-omni's sense (a positive turn about +X looks up, about +Y right): the same
# cameras as vllm-omni's example client (and `key_velocity`) sends for each key.
EXPECTED = {
    "w": ([0, 0, STEP], STILL),
    "s": ([0, 0, -STEP], STILL),
    "a": ([-STEP, 0, 0], STILL),
    "d": ([STEP, 0, 0], STILL),
    "ArrowUp": (NO_MOVE, turn((1, 0, 0), 4)),
    "ArrowDown": (NO_MOVE, turn((1, 0, 0), -4)),
    "ArrowLeft": (NO_MOVE, turn((0, 1, 0), -6)),
    "ArrowRight": (NO_MOVE, turn((0, 1, 0), 6)),
    "i": (NO_MOVE, turn((1, 0, 0), 4)),
    "k": (NO_MOVE, turn((1, 0, 0), -4)),
    "j": (NO_MOVE, turn((0, 1, 0), -6)),
    "l": (NO_MOVE, turn((0, 1, 0), 6)),
    "x": (NO_MOVE, STILL),
}


@pytest.fixture(scope="module")
def shapes_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("player-shapes") / "server.log"
    # One torch thread: the browser needs the other core.
    with serve(log, engine=("--engine", "shapes", "--engine-arg", "threads=1")) as url:
        yield url


@pytest.fixture(scope="module")
def synthetic_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(tmp_path_factory.mktemp("player-synthetic") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with launch_chromium() as browser:
        yield browser


@pytest.fixture
def shapes_page(browser: Browser, shapes_url: str) -> Iterator[Page]:
    with open_player(browser, shapes_url) as page:
        yield page


def start_shapes(page: Page, prompt: str, seconds: int) -> None:
    page.fill("#prompt", prompt)
    page.fill("#size", "128x128")
    page.fill("#fps", str(FPS))
    page.fill("#seed", "9")
    page.fill("#length", str(seconds))
    page.select_option("#length-unit", "seconds")
    expect(page.locator("#live")).to_be_checked()
    page.click("#start")


def cameras_sent(sent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m["interaction"] for m in sent if m["type"] == "session.interaction"]


def event(page: Page, number: int) -> Any:
    return page.locator(f'#timeline li[data-event-id="interaction-{number}"]')


def assert_camera(
    interaction: dict[str, Any], translation: list[float], rotation: list[float]
) -> None:
    assert interaction["transition_chunks"] == 0
    camera = interaction["event"]["multi_modal_data"]["camera"]
    assert interaction["event"].keys() == {"multi_modal_data"}  # no prompt: keep it
    assert camera["mode"] == "velocity"
    assert camera["data"]["translation"] == pytest.approx(translation, abs=1e-12)
    assert camera["data"]["rotation"] == pytest.approx(rotation, abs=1e-12)


def test_pressing_d_turns_an_object_moving_left_to_the_right(
    shapes_page: Page, tmp_path: Path
) -> None:
    page = shapes_page
    panel = page.locator("#camera-panel")
    expect(panel).to_be_visible()  # /v1/models lists "camera" for shapes
    expect(page.get_by_role("button", name="Move right (D)")).to_be_disabled()  # not streaming
    expect(page.locator("#camera-legend")).to_contain_text("W")
    sent = sent_messages(page)

    start_shapes(page, "a red square moving left on a black background", seconds=8)
    wait_playing(page, 1.0)
    expect(page.get_by_role("button", name="Move right (D)")).to_be_enabled()
    # In a text field a key is typing, not steering.
    page.focus("#interact-prompt")
    page.keyboard.press("d")
    expect(page.locator("#interact-prompt")).to_have_value("d")
    page.focus("#video")
    page.keyboard.press("d")

    pressed = event(page, 1)
    expect(pressed).to_have_attribute("data-start-time", re.compile(r"^\d"))
    start_time = float(pressed.get_attribute("data-start-time") or "nan")
    # The latency: from sending to the first frame of the chunk that starts the event.
    latency = page.locator("#fig-key-latency")
    expect(latency).to_have_attribute("data-ms", re.compile(r"^\d"))
    ms = float(latency.get_attribute("data-ms") or "nan")
    assert 0 < ms < 4000, ms
    # The same figure in whole milliseconds (data-ms is itself rounded to a tenth, so
    # 1697.46 shows as "1697 ms" beside data-ms 1697.5).
    shown = latency.inner_text()
    assert re.fullmatch(r"\d+ ms", shown), shown
    assert abs(int(shown.split()[0]) - ms) <= 0.55, (shown, ms)
    expect(page.locator("#fig-key-p50")).to_have_attribute("data-count", "1")
    assert float(page.locator("#fig-key-p50").get_attribute("data-ms") or "nan") == ms
    assert float(pressed.get_attribute("data-latency-ms") or "nan") == ms
    # Measured when a frame of that chunk was on screen, not before.
    shown_at = float(pressed.get_attribute("data-shown-at") or "nan")
    assert start_time - 1e-3 <= shown_at < start_time + 1.0, (start_time, shown_at)

    wait_playing(page, start_time + 1.5)
    page.click("#stop")
    expect(page.locator("#status")).to_contain_text("session.done")
    expect(page.locator("#errors")).to_be_empty()

    # The effect: the object moved left before the event's chunk and right from it on.
    with page.expect_download() as download:
        page.click("#save")
    path = tmp_path / "steered.mp4"
    download.value.save_as(path)
    frames = decode_video(path.read_bytes())
    switch = round(start_time * FPS)
    assert 8 <= switch <= len(frames) - 16, (switch, len(frames))
    assert evaluate.analyse_clip(frames[:switch]).motion == "left"
    assert evaluate.analyse_clip(frames[switch:]).motion == "right"
    # What the page sent for it: vllm-omni's camera velocity.
    [interaction] = cameras_sent(sent)
    assert interaction["event_id"] == "interaction-1"
    assert_camera(interaction, [STEP, 0, 0], STILL)


def test_every_key_and_button_sends_its_camera_velocity(shapes_page: Page) -> None:
    page = shapes_page
    sent = sent_messages(page)
    # Before the stream runs, keys do nothing.
    page.keyboard.press("d")
    expect(page.locator("#timeline li")).to_have_count(0)

    start_shapes(page, "a blue circle moving up on a gray background", seconds=20)
    wait_playing(page, 0.3)
    page.focus("#video")
    for key in EXPECTED:
        page.keyboard.press(key)
    # A held key sends once: its auto-repeat is ignored.
    page.keyboard.down("w")
    page.keyboard.down("w")
    page.keyboard.up("w")
    page.get_by_role("button", name="Move left (A)").click()
    page.get_by_role("button", name="Hold still (X)").click()
    count = len(EXPECTED) + 3

    # The server acknowledged every one (queued, or already further along).
    for number in range(1, count + 1):
        expect(event(page, number)).not_to_have_attribute(
            "data-state", re.compile("^(sent|failed)$")
        )
    expect(page.locator("#timeline li")).to_have_count(count)
    expect(page.locator("#fig-key-p50")).to_have_attribute("data-count", re.compile(r"^[1-9]"))
    # Every one reaches its chunk before the stop (they start in order, so the last one
    # last): a stop refuses those still held, and the page would show that refusal.
    expect(event(page, count)).to_have_attribute(
        "data-state", re.compile("^(started|active|completed)$"), timeout=15_000
    )
    page.click("#stop")
    expect(page.locator("#status")).to_contain_text("session.done")
    # After the session, keys do nothing again.
    page.keyboard.press("d")
    expect(page.locator("#timeline li")).to_have_count(count)

    interactions = cameras_sent(sent)
    assert [i["event_id"] for i in interactions] == [
        f"interaction-{n}" for n in range(1, count + 1)
    ]
    expected = [*EXPECTED.values(), EXPECTED["w"], EXPECTED["a"], EXPECTED["x"]]
    for interaction, (translation, rotation) in zip(interactions, expected, strict=True):
        assert_camera(interaction, translation, rotation)
    errors = page.locator("#errors").inner_text()
    assert errors == "", errors


def test_a_refused_camera_shows_the_servers_error(shapes_page: Page) -> None:
    page = shapes_page
    start_shapes(page, "a green triangle moving right on a navy background", seconds=20)
    wait_playing(page, 0.3)
    # The controls only send velocities; a "target" pose goes through the page's hook.
    event_id = page.evaluate(
        """async () => (await import("/static/player.js")).sendCamera(
            {mode: "target", data: {translation: [1, 0, 0], rotation: [0, 0, 0, 1]}}, "target")"""
    )
    assert event_id == "interaction-1"
    expect(event(page, 1)).to_have_attribute("data-state", "failed")
    errors = page.locator("#errors")
    expect(errors).to_contain_text("interaction_failed")
    expect(errors).to_contain_text("steers by camera velocity only")
    expect(errors).to_contain_text("(event interaction-1)")
    # The session goes on: the next key is taken.
    page.focus("#video")
    page.keyboard.press("ArrowLeft")
    expect(event(page, 2)).to_have_attribute("data-state", re.compile("started|active|completed"))
    page.click("#stop")
    expect(page.locator("#status")).to_contain_text("session.done")


def test_a_prompt_only_engine_shows_no_camera_controls(
    browser: Browser, synthetic_url: str
) -> None:
    with open_player(browser, synthetic_url) as page:
        expect(page.locator("#model-info")).to_contain_text("synthetic")
        expect(page.locator("#camera-panel")).to_be_hidden()
        expect(page.locator("#fig-key-latency")).to_be_hidden()
        expect(page.locator("#interact-form")).to_be_visible()
        sent = sent_messages(page)
        page.fill("#length", "20")
        page.select_option("#length-unit", "seconds")
        page.click("#start")
        wait_playing(page, 0.3)
        page.focus("#video")
        page.keyboard.press("d")
        page.keyboard.press("ArrowUp")
        # A prompt sent after the keys is the only interaction the page sent.
        page.fill("#interact-prompt", "a blue square")
        page.click("#send")
        expect(event(page, 1)).to_have_attribute("data-state", re.compile("queued|started|active"))
        expect(page.locator("#timeline li")).to_have_count(1)
        page.click("#stop")
        expect(page.locator("#status")).to_contain_text("session.done")
        interactions = cameras_sent(sent)
        assert interactions == [{"event_id": "interaction-1", "event": {"prompt": "a blue square"}}]
        expect(page.locator("#errors")).to_be_empty()


# The page's messages, held back in the page while it catches up: its WebSocket's
# "message" listeners are wrapped (before Start opens the socket). Until catch-up starts,
# each message goes straight through ("early"); from the message after which the video
# plays fast, every message is held ("holding"), so the page plays through what it has
# buffered and the video waits; then, in a task after the "waiting" event (so after the
# player's own listener marked the stall), the held messages go through ("released"): the
# first media chunk among them arrives after the playhead needed it. `start` and `stop`
# are liveStats() right after the message that started catch-up and the one that stopped
# it: which chunk decided each, and on what slack.
HOLD_ONCE_CATCHING_UP = """async () => {
    const player = window.player = await import("/static/player.js");
    const video = document.getElementById("video");
    const late = window.late = {state: "early", held: [], start: null, stop: null};
    const deliver = (listener, socket, event) => {
        const before = video.playbackRate;
        listener.call(socket, event);
        const after = video.playbackRate;
        if (before > 1 && after === 1) late.stop ??= player.liveStats();
        if (late.state === "early" && after > 1) {
            late.state = "holding";
            late.start = player.liveStats();
        }
    };
    video.addEventListener("waiting", () => {
        // Not a seek's (the page's jump to the live edge): out of media.
        if (late.state !== "holding" || video.seeking) return;
        late.state = "releasing";
        setTimeout(() => {
            late.state = "released";
            for (const held of late.held.splice(0)) deliver(...held);
        });
    });
    const addEventListener = WebSocket.prototype.addEventListener;
    WebSocket.prototype.addEventListener = function (type, listener, options) {
        if (type !== "message") return addEventListener.call(this, type, listener, options);
        return addEventListener.call(this, type, function (event) {
            if (late.state === "holding" || late.state === "releasing") {
                late.held.push([listener, this, event]);
            } else {
                deliver(listener, this, event);
            }
        }, options);
    };
}"""


def test_live_catches_up_while_chunks_arrive_early_and_stops_when_one_is_late(
    shapes_page: Page,
) -> None:
    """The test makes both conditions itself rather than wait for the machine's jitter
    to make them. Early: the page asks for a 1 s window and starts playing once 0.8 s
    is buffered, and the engine runs 1 step a chunk, so the chunks, made in real time
    (the action windows), arrive over half a second before the playhead needs them, far
    beyond any jitter of a loaded machine (and the lag stays under the 1.5 s at which
    the page jumps to the live edge). Late: once catch-up starts, the page's
    messages are held until the video waits (`HOLD_ONCE_CATCHING_UP`)."""
    page = shapes_page
    # Catch up from any slack at all, after 3 chunks: it must start (chunks arrive before
    # the playhead needs them), and stop once one arrives with none left.
    page.evaluate(
        """async () => Object.assign((await import("/static/player.js")).LIVE,
            {slackSeconds: 0, slackChunks: 3, bufferSeconds: 1.0, startSeconds: 0.8})"""
    )
    page.evaluate(HOLD_ONCE_CATCHING_UP)
    page.fill("#steps", "1")
    start_shapes(page, "a red circle still on a navy background", seconds=60)
    wait_playing(page, 0.3)
    page.wait_for_function("() => window.player.liveStats().playbackRate > 1")
    started = page.evaluate("() => window.late.start")
    assert started["catchUps"] == 1, started
    # It started on 3 chunks that all came early.
    assert len(started["slacks"]) == 3 and min(started["slacks"]) > 0, started["slacks"]
    page.wait_for_function(
        """() => {
            const stats = window.player.liveStats();
            return stats.catchUps >= 1 && stats.playbackRate === 1;
        }"""
    )
    stopped = page.evaluate("() => window.late.stop")
    # It stopped at the chunk held back until the video waited: that one came late.
    assert stopped is not None and stopped["slacks"][-1] < 0, stopped
    assert stopped["underruns"] >= 1, stopped
    page.click("#stop")
    expect(page.locator("#status")).to_contain_text("session.done")
    expect(page.locator("#errors")).to_be_empty()


def test_live_sends_the_engines_live_defaults_unless_the_form_sets_them(
    shapes_page: Page,
) -> None:
    """shapes suggests 3 steps without guidance for live sessions (/v1/models
    live_defaults): Live sends them for empty fields, a typed Steps wins, Live off sends
    the engine's ordinary defaults (nothing)."""
    page = shapes_page
    sent = sent_messages(page)
    starts = []
    for live, steps in ((True, ""), (True, "5"), (False, "")):
        page.fill("#steps", steps)
        if live:
            page.check("#live")
        else:
            page.uncheck("#live")
        page.fill("#length", "1")
        page.select_option("#length-unit", "seconds")
        page.click("#start")
        expect(page.locator("#status")).to_contain_text("session.done")
        starts.append(next(m for m in reversed(sent) if m["type"] == "session.start"))
    assert (starts[0]["num_inference_steps"], starts[0]["guidance_scale"]) == (3, 1.0)
    assert (starts[1]["num_inference_steps"], starts[1]["guidance_scale"]) == (5, 1.0)
    assert "num_inference_steps" not in starts[2] and "guidance_scale" not in starts[2]
    # What a server suggests is read as data: only known fields with finite numbers.
    kept = page.evaluate(
        """async () => (await import("/static/player.js")).liveDefaults({
            num_inference_steps: 2, guidance_scale: "1", flow_shift: null,
            prompt: "x", __proto__: {seed: 1}})"""
    )
    assert kept == {"num_inference_steps": 2}
    expect(page.locator("#errors")).to_be_empty()

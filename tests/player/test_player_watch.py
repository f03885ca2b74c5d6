"""The player page's share link, in a real browser (see ``tests/player/test_player.py``): the
owner's page shows a watch link; a second page opened from it plays the same stream
live, read-only, from where it joined, and saves what it received. Beside the link, "Share
as HLS" offers the session's playlist URL (``hls_path``) when the server names one on
itself (hls.js playing it: ``tests/player/test_player_hls.py``). Every wait is on state
the pages show."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, WebSocketRoute, expect

from tests.conftest import decode_video
from tests.player.test_player import (
    CHROMIUM,
    CHUNK_FRAMES,
    WAIT_MS,
    cosine,
    launch_chromium,
    mean_rgb,
    open_player,
    serve,
    start,
    wait_playing,
)
from trio_vstream.engines.synthetic import prompt_colour
from trio_vstream.outputs.watch import WATCH_PREFIX

pytestmark = [
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)",
    ),
    pytest.mark.timeout(120),
]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve(tmp_path_factory.mktemp("player-watch") / "server.log") as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with launch_chromium() as browser:
        yield browser


def test_a_share_link_plays_the_stream_live_and_read_only(browser: Browser, base_url: str) -> None:
    prompt = "a red circle"
    with open_player(browser, base_url) as owner:
        owner.fill("#prompt", prompt)
        start(owner, seconds=20)
        wait_playing(owner, 0.3)
        share = owner.locator("#share-link")
        expect(share).to_be_visible()
        link = share.input_value()
        assert link.startswith(f"{base_url}/?watch=")
        assert WATCH_PREFIX.replace("/", "%2F") in link

        # A fresh context: no key, no state shared with the owner's page.
        context = browser.new_context(viewport={"width": 1000, "height": 900})
        viewer = context.new_page()
        viewer.set_default_timeout(WAIT_MS)
        script_errors: list[str] = []
        viewer.on("pageerror", lambda error: script_errors.append(str(error)))
        viewer.goto(link)
        expect(viewer.locator("#status")).to_contain_text("Watching live")
        wait_playing(viewer, 0.5)
        # Read-only: no request form, no prompt box, no camera; the prompt is shown.
        for hidden in ("#start-form", "#interact-form", "#camera-panel", "#share"):
            expect(viewer.locator(hidden)).to_be_hidden()
        expect(viewer.locator("#watch-note")).to_be_visible()
        expect(viewer.locator("#model-info")).to_contain_text(prompt)
        expect(viewer.locator("#fig-request")).to_have_text(
            owner.locator("#fig-request").text_content() or "?"
        )
        # The viewer shows the owner's video: the prompt's colour, not another's.
        colour = mean_rgb(viewer)
        other = prompt_colour("a green triangle")
        assert cosine(colour, prompt_colour(prompt)) > cosine(colour, other), colour

        owner.click("#stop")
        expect(owner.locator("#status")).to_contain_text("session.done")
        status = viewer.locator("#status")
        expect(status).to_contain_text("session.done")
        expect(status).to_contain_text("stopped")
        expect(viewer.locator("#errors")).to_be_empty()
        context.close()
        assert script_errors == [], "the viewer's page raised JavaScript errors"


def test_a_viewer_saves_what_it_received_as_an_mp4(
    browser: Browser, base_url: str, tmp_path: Path
) -> None:
    with open_player(browser, base_url) as owner:
        expect(owner.locator("#watch-save")).to_be_hidden()  # the owner's Save is in the form
        start(owner, seconds=30)
        owner.wait_for_function(
            "() => Number(document.getElementById('fig-chunks').textContent) >= 2"
        )
        link = owner.locator("#share-link").input_value()

        context = browser.new_context(accept_downloads=True)
        viewer = context.new_page()
        viewer.set_default_timeout(WAIT_MS)
        viewer.goto(link)
        save = viewer.locator("#watch-save")
        expect(save).to_be_visible()
        viewer.wait_for_function(
            "() => Number(document.getElementById('fig-chunks').textContent) >= 1"
        )
        expect(save).to_be_enabled()
        owner.click("#stop")
        expect(owner.locator("#status")).to_contain_text("session.done")
        expect(viewer.locator("#status")).to_contain_text("session.done")

        files = {}
        for name, page, button in (("owner", owner, "#save"), ("viewer", viewer, "#watch-save")):
            with page.expect_download() as download:
                page.click(button)
            files[name] = tmp_path / f"{name}.mp4"
            download.value.save_as(files[name])
            assert download.value.suggested_filename.endswith(".mp4")
        viewer_chunks = int(viewer.locator("#fig-chunks").text_content() or "0")
        context.close()
    # The viewer's file decodes on its own: the owner's frames from where it joined.
    mine, theirs = (
        decode_video(files["viewer"].read_bytes()),
        decode_video(files["owner"].read_bytes()),
    )
    assert mine.shape[0] == viewer_chunks * CHUNK_FRAMES
    assert 0 < mine.shape[0] < theirs.shape[0]
    assert (mine == theirs[theirs.shape[0] - mine.shape[0] :]).all()


def test_a_share_link_of_an_ended_session_says_so(browser: Browser, base_url: str) -> None:
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(f"{base_url}/?watch={WATCH_PREFIX}no-such-token")
    expect(page.locator("#errors")).to_contain_text("watch_not_found")
    expect(page.locator("#start-form")).to_be_hidden()
    # A watch parameter that is not a path on this server is not followed.
    page.goto(f"{base_url}/?watch=//example.org/x")
    expect(page.locator("#start-form")).to_be_visible()
    context.close()


def test_the_page_offers_the_hls_url_beside_the_watch_link(browser: Browser, base_url: str) -> None:
    with open_player(browser, base_url) as page:
        started: list[dict[str, Any]] = []

        def on_socket(socket: Any) -> None:
            def on_frame(payload: str | bytes) -> None:
                if isinstance(payload, str) and '"video.start"' in payload:
                    started.append(json.loads(payload))

            socket.on("framereceived", on_frame)

        page.on("websocket", on_socket)
        start(page, seconds=20)
        field = page.locator("#share-hls-url")
        expect(field).to_be_visible()
        expect(page.locator("#share-link")).to_be_visible()
        hls_path = started[0]["hls_path"]
        assert field.input_value() == base_url + hls_path
        # The URL is the playlist, as any HTTP client gets it.
        with urllib.request.urlopen(field.input_value(), timeout=10) as response:
            assert response.read().startswith(b"#EXTM3U")
        page.click("#share-hls-copy")
        # Either: headless chromium may deny the clipboard.
        expect(page.locator("#share-hls-copy")).to_have_text(
            re.compile(r"^(Copied|Press Ctrl\+C)$")
        )
        page.click("#stop")
        expect(page.locator("#status")).to_contain_text("session.done")


@pytest.mark.parametrize(
    "hls_path",
    [None, "https://evil.example/x.m3u8"],
)
def test_no_hls_url_without_a_path_on_this_server(
    browser: Browser, base_url: str, hls_path: object
) -> None:
    """``hls_path`` is what the server says: absent (``--no-hls``) or not a path on this
    server, the page offers no HLS URL, and still the watch link."""

    def rewrite(ws: WebSocketRoute) -> None:
        server = ws.connect_to_server()

        def to_page(message: str | bytes) -> None:
            if isinstance(message, str) and '"video.start"' in message:
                decoded = json.loads(message)
                decoded.pop("hls_path", None)
                if hls_path is not None:
                    decoded["hls_path"] = hls_path
                message = json.dumps(decoded)
            ws.send(message)

        server.on_message(to_page)

    with open_player(browser, base_url) as page:
        page.route_web_socket("**/v1/realtime/video", rewrite)
        start(page, seconds=20)
        expect(page.locator("#share-link")).to_be_visible()
        expect(page.locator("#share-hls")).to_be_hidden()
        assert page.locator("#share-hls-url").input_value() == ""
        page.click("#stop")
        expect(page.locator("#status")).to_contain_text("session.done")


def test_the_hls_url_is_checked_like_a_watch_path(browser: Browser, base_url: str) -> None:
    with open_player(browser, base_url) as page:
        urls = page.evaluate(
            """async (paths) => {
                const { hlsUrl } = await import("/static/player.js");
                return paths.map((path) => hlsUrl(path));
            }""",
            ["/v1/realtime/video/watch/abc/hls/index.m3u8", "//evil", "javascript:x", "", "/a b"],
        )
    assert urls == [f"{base_url}/v1/realtime/video/watch/abc/hls/index.m3u8", *[None] * 4]

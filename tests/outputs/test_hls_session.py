"""The LL-HLS window as a real session's tap: what it serves is what the owner received,
sound included, and a viewer blocked on the next part is answered as the session goes."""

from __future__ import annotations

import json
from typing import Any

import m3u8
import numpy as np
import trio
import trio.testing

from tests.conftest import Transcript, decode_video, receive_into, receive_until
from trio_vstream import protocol
from trio_vstream.client._mp4 import decode_audio
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.media.aac import AAC_FRAME
from trio_vstream.outputs.hls import HlsSettings, HlsWindow
from trio_vstream.outputs.taps import SessionTaps
from trio_vstream.values import audio_samples_through

FPS, CHUNK_FRAMES, NUM_FRAMES = 8, 4, 20
START = {
    "type": "session.start",
    "prompt": "a tone",
    "size": "32x32",
    "fps": FPS,
    "num_frames": NUM_FRAMES,
}
SOUND = SyntheticSettings(chunk_frames=CHUNK_FRAMES, audio_tone=440.0, audio_sample_rate=48000)
TOTAL_SAMPLES = audio_samples_through(NUM_FRAMES, 48000, FPS)


def hls_taps(windows: list[HlsWindow]) -> Any:
    def factory(request_id: str, start: protocol.SessionStart) -> SessionTaps:
        window = HlsWindow(HlsSettings(), max_part_seconds=CHUNK_FRAMES / FPS)
        windows.append(window)
        return SessionTaps([window])

    return factory


async def get(window: HlsWindow, resource: str, **query: str) -> bytes:
    answer = await window.respond(resource, query)
    assert answer.status == 200, (resource, answer)
    return answer.body


async def test_a_sessions_parts_are_the_owners_chunks_with_their_sound(start_server: Any) -> None:
    windows: list[HlsWindow] = []
    running = await start_server(SOUND, taps=hls_taps(windows))
    owner = await running.run_session(START)
    [window] = windows
    assert window.ended_at is not None
    kinds = [m["kind"] for m in owner.of_type("video.chunk_metadata")]
    assert kinds == ["media"] * (NUM_FRAMES // CHUNK_FRAMES) + ["trailer"]
    chunks = [m for m in owner.messages if isinstance(m, bytes)]
    media = chunks[:-1]
    init = media[0][: media[0].index(b"moof") - 4]
    assert b"mp4a" in init  # the stream has sound, in the same fragments

    playlist = m3u8.loads(window.playlist())
    assert playlist.is_endlist
    parts = [part for segment in playlist.segments for part in segment.parts]
    assert [p.duration for p in parts] == [CHUNK_FRAMES / FPS] * len(media)
    assert await get(window, "init.mp4") == init
    assert [await get(window, p.uri) for p in parts] == [media[0][len(init) :], *media[1:]]
    stream = init + b"".join([await get(window, s.uri) for s in playlist.segments])
    # The owner's stream less the trailer (an index box, and the last AAC frame or two).
    assert stream == b"".join(media)

    frames = decode_video(stream)
    assert frames.shape[0] == NUM_FRAMES
    np.testing.assert_array_equal(frames, decode_video(owner.video_bytes))
    ours, theirs = decode_audio(stream), decode_audio(owner.video_bytes)
    assert ours is not None and theirs is not None
    assert theirs[1].shape[1] == TOTAL_SAMPLES
    # Short of the trailer's sound: what the AAC encoder still held (its FIFO's rest, less
    # than a frame, and the frame or two its packets lag behind).
    heard = ours[1].shape[1]
    assert TOTAL_SAMPLES - 3 * AAC_FRAME < heard < TOTAL_SAMPLES
    np.testing.assert_allclose(ours[1], theirs[1][:, :heard], atol=1e-6)


async def test_a_blocked_viewer_follows_the_session_part_by_part(start_server: Any) -> None:
    windows: list[HlsWindow] = []
    # Slow steps, so that the session is still running when the viewer asks.
    running = await start_server(
        SyntheticSettings(chunk_frames=CHUNK_FRAMES, step_delay=0.05), taps=hls_taps(windows)
    )
    owner = Transcript()
    seen: list[str] = []
    async with running.connect() as ws:
        await ws.send_message(json.dumps(START))
        await receive_until(ws, owner, lambda m: isinstance(m, dict))  # video.start
        [window] = windows
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive_into, ws, owner)
            # A player's loop: ask for the hinted part's playlist, then the next.
            with trio.fail_after(30):
                while True:
                    playlist = m3u8.loads(window.playlist())
                    if playlist.is_endlist:
                        break
                    msn, index = playlist.preload_hint.uri[5:-4].split(".")
                    answer = await window.respond(
                        "index.m3u8", {"_HLS_msn": msn, "_HLS_part": index}
                    )
                    assert answer.status == 200
                    text = answer.body.decode()
                    if "#EXT-X-ENDLIST" not in text:
                        assert f"part/{msn}.{index}.m4s" in text
                        seen.append(f"{msn}.{index}")
    assert len(seen) >= 2  # it was answered as parts came, not only at the end
    assert seen == sorted(set(seen), key=lambda s: tuple(map(int, s.split("."))))

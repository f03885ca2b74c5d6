"""Sound beyond the owner's stream (issue 23): a watch link's viewers get the same init
segment (both tracks) and chunks; a recording keeps the sound in its MP4 and notes it in
its JSON; ``replay`` compares the sound as it compares the frames."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import trio

from tests.conftest import Transcript, decode_video, receive_into, receive_until
from tests.outputs.test_watch import binaries, chunk_indexes, watch
from trio_vstream.client import load_recording, replay
from trio_vstream.client._mp4 import decode_audio
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.outputs.recording import Recorder
from trio_vstream.values import audio_samples_through

START = {"type": "session.start", "prompt": "a tone", "size": "32x32", "fps": 8, "num_frames": 20}
SOUND = SyntheticSettings(chunk_frames=4, audio_tone=440.0, audio_sample_rate=48000)
OTHER_TONE = SyntheticSettings(chunk_frames=4, audio_tone=660.0, audio_sample_rate=48000)
TOTAL = audio_samples_through(20, 48000, 8)


def is_bytes(message: object) -> bool:
    return isinstance(message, bytes)


async def test_a_viewer_gets_the_same_init_segment_and_chunks_with_sound(
    start_server: Any,
) -> None:
    running = await start_server(SOUND)
    owner, viewer = Transcript(), Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps(START))
        video_start = await receive_until(ws, owner, lambda m: isinstance(m, dict))
        for _ in range(2):
            await receive_until(ws, owner, is_bytes)
        async with watch(running, video_start["watch_path"]) as watcher, trio.open_nursery() as n:
            n.start_soon(receive_into, watcher, viewer)
            await receive_into(ws, owner)
    assert viewer.messages[0]["config"]["audio"] == video_start["config"]["audio"]
    first = chunk_indexes(viewer)[0]
    assert first >= 2
    ours, theirs = binaries(viewer), binaries(owner)
    # The owner's first message begins with the init segment (ftyp, moov: both tracks):
    # a viewer's first one is that init segment followed by the chunk it joined at, and
    # the rest are the owner's chunks, byte for byte.
    init = theirs[0][: theirs[0].index(b"moof") - 4]
    assert b"soun" in init and b"mp4a" in init
    assert ours[0] == init + theirs[first]
    assert ours[1:] == theirs[first + 1 :]
    for message in viewer.of_type("video.chunk_metadata"):
        if message["kind"] == "media":
            assert message["audio_sample_rate"] == 48000 and message["num_audio_samples"] > 0
    decoded = decode_audio(viewer.video_bytes)
    assert decoded is not None
    _, pcm = decoded
    owner_audio = decode_audio(owner.video_bytes)
    assert owner_audio is not None
    # The viewer's sound is the owner's tail (its first AAC frame decodes without the
    # one before it, so only the rest is compared).
    tail = pcm.shape[1] - 2048
    assert tail > 0
    np.testing.assert_allclose(pcm[:, -tail:], owner_audio[1][:, -tail:], atol=1e-3)
    assert decode_video(viewer.video_bytes).shape[0] == 20 - first * 4


async def test_a_recording_keeps_the_sound_and_a_replay_compares_it(
    start_server: Any, tmp_path: Path
) -> None:
    recorder = Recorder(tmp_path / "rec", engine="synthetic", model="synthetic")
    running = await start_server(SOUND, taps=recorder)
    transcript = await running.run_session(START)
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    request_id = transcript.messages[0]["request_id"]
    json_path = tmp_path / "rec" / f"{request_id}.json"
    record = json.loads(json_path.read_text())
    assert record["audio"] == {"sample_rate": 48000, "channels": 1, "codec": "mp4a.40.2"}
    assert "audio" not in record["request"], "the server's echo is no request field"
    media = [c for c in record["chunks"] if c["kind"] == "media"]
    assert sum(c["audio_samples"] for c in media) == TOTAL
    saved = decode_audio((tmp_path / "rec" / f"{request_id}.mp4").read_bytes())
    assert saved is not None
    sent = decode_audio(transcript.video_bytes)
    assert sent is not None and sent[1].shape == (1, TOTAL)
    np.testing.assert_array_equal(saved[1][:, :TOTAL], sent[1])

    plan = load_recording(json_path)
    assert plan.recorded_audio_samples == TOTAL
    assert "audio" not in plan.start_fields
    report = await replay(plan, running.url)
    assert report.mismatches == []
    assert report.result.audio_samples == TOTAL
    assert report.audio_correlation is not None and report.audio_correlation > 0.999
    summary = report.result.summary()
    assert summary["audio"] == {"sample_rate": 48000, "samples": TOTAL}

    # The same request on a server whose tone differs: the frames agree, the sound not.
    other = await start_server(OTHER_TONE)
    differing = await replay(plan, other.url)
    assert differing.frames_compared == 20
    assert [m for m in differing.mismatches if "sound differs" in m], (
        differing.mismatches,
        differing.audio_correlation,
        differing.result.summary(),
    )

    # And on one without sound at all.
    silent = await start_server(SyntheticSettings(chunk_frames=4))
    mute = await replay(plan, silent.url)
    assert "the replay has no sound, the recording has" in mute.mismatches

"""Sound end to end through a real server: the synthetic engine's tone (``audio_tone``)
comes out of the joined stream exactly, and the messages say the stream has it."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest

from tests.conftest import decode_video
from tests.instrumented import InstrumentedEngine, InstrumentedStream
from trio_vstream.client._mp4 import decode_audio
from trio_vstream.engines.contract import Checkpoint, Chunk, EngineConfigError, GenerationRequest
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.server.app import ServerConfig, VideoServer
from trio_vstream.values import audio_samples_through

START = {"type": "session.start", "prompt": "a tone", "size": "32x32", "fps": 7, "num_frames": 17}
SOUND = SyntheticSettings(chunk_frames=3, audio_tone=440.0, audio_sample_rate=44100)


async def test_a_stream_with_sound_carries_the_tone_exactly(start_server: Any) -> None:
    running = await start_server(SOUND)
    transcript = await running.run_session(START)
    assert transcript.terminal[-1]["type"] == "session.done", transcript.terminal
    (video_start,) = transcript.of_type("video.start")
    assert video_start["config"]["audio"] == {
        "sample_rate": 44100,
        "channels": 1,
        "codec": "mp4a.40.2",
    }
    metadata = transcript.of_type("video.chunk_metadata")
    media = [m for m in metadata if m["kind"] == "media"]
    # Each chunk's count is its frames' duration, rounded cumulatively: 44100 / 7 is no
    # whole number of samples a frame.
    done = 0
    for message in media:
        assert message["audio_sample_rate"] == 44100
        begin = audio_samples_through(done, 44100, 7)
        done += message["num_frames"]
        assert message["num_audio_samples"] == audio_samples_through(done, 44100, 7) - begin
    assert done == 17
    (trailer,) = [m for m in metadata if m["kind"] == "trailer"]
    assert (trailer["num_audio_samples"], trailer["audio_sample_rate"]) == (0, 44100)
    decoded = decode_audio(transcript.video_bytes)
    assert decoded is not None
    rate, pcm = decoded
    total = audio_samples_through(17, 44100, 7)
    assert rate == 44100 and pcm.shape == (1, total)
    expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(total) / 44100)
    assert np.corrcoef(pcm[0], expected)[0, 1] > 0.99


async def test_a_stream_without_sound_says_nothing_of_it(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=3))
    transcript = await running.run_session(START)
    assert "audio" not in transcript.of_type("video.start")[0]["config"]
    for message in transcript.of_type("video.chunk_metadata"):
        assert "num_audio_samples" not in message and "audio_sample_rate" not in message
    assert decode_audio(transcript.video_bytes) is None


class ShortSound(InstrumentedEngine):
    """An engine with sound whose second chunk is one sample short."""

    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        stream = super().open_stream(request)
        next_chunk = stream.next_chunk

        def short(checkpoint: Checkpoint) -> Chunk | None:
            chunk = next_chunk(checkpoint)
            if chunk is not None and chunk.index == 1:
                chunk = attrs.evolve(chunk, audio=chunk.audio[:-1])
            return chunk

        stream.next_chunk = short  # type: ignore[method-assign]
        return stream


@pytest.mark.parametrize("engine_class", [ShortSound])
async def test_sound_of_the_wrong_length_fails_the_session(
    start_server: Any, engine_class: type[InstrumentedEngine]
) -> None:
    running = await start_server(SOUND, engine_class=engine_class)
    transcript = await running.run_session(START)
    (error,) = transcript.terminal
    assert error["type"] == "error"
    assert "audio samples" in error["message"], error
    # The chunk before it went out whole; the broken one did not.
    assert len([m for m in transcript.of_type("video.chunk_metadata")]) == 1


async def test_a_client_cannot_claim_sound_in_its_session_start(start_server: Any) -> None:
    """``audio`` is the server's word in ``video.start``, not a request field."""
    running = await start_server(SyntheticSettings(chunk_frames=3))
    claim = {"sample_rate": 48000, "channels": 2, "codec": "mp4a.40.2"}
    transcript = await running.run_session({**START, "audio": claim})
    (error,) = transcript.terminal
    assert error["code"] == "invalid_request" and "audio" in error["message"]
    assert not transcript.of_type("video.start")


def test_an_engine_whose_sound_the_server_cannot_carry_fails_at_start_up() -> None:
    engine = InstrumentedEngine(SyntheticSettings())
    engine.audio_sample_rate = 96000
    with pytest.raises(EngineConfigError, match="audio_sample_rate must be one of"):
        VideoServer(engine, ServerConfig(host="127.0.0.1", port=0))


# -- generate_sound and sound_duration, as vllm-omni means them


def media_of(transcript: Any) -> list[dict[str, Any]]:
    return [m for m in transcript.of_type("video.chunk_metadata") if m["kind"] == "media"]


async def test_generate_sound_true_streams_the_engines_sound(start_server: Any) -> None:
    running = await start_server(SOUND)
    transcript = await running.run_session(
        {**START, "generate_sound": True, "sound_duration": 17 / 7}
    )
    assert transcript.terminal[-1]["type"] == "session.done", transcript.terminal
    (video_start,) = transcript.of_type("video.start")
    assert video_start["config"]["audio"]["sample_rate"] == 44100
    assert video_start["config"]["generate_sound"] is True
    media = media_of(transcript)
    assert sum(m["num_frames"] for m in media) == 17
    assert sum(m["num_audio_samples"] for m in media) == audio_samples_through(17, 44100, 7)
    decoded = decode_audio(transcript.video_bytes)  # the init segment has an audio track
    assert decoded is not None and decoded[1].shape == (1, audio_samples_through(17, 44100, 7))


async def test_generate_sound_false_makes_a_video_without_an_audio_track(
    start_server: Any,
) -> None:
    """The engine makes its tone all the same; the session's video has no track for it,
    and its messages say nothing of sound: the frames are those of the video with sound."""
    running = await start_server(SOUND)
    silent = await running.run_session({**START, "generate_sound": False})
    assert silent.terminal[-1]["type"] == "session.done", silent.terminal
    assert "audio" not in silent.of_type("video.start")[0]["config"]
    for message in silent.of_type("video.chunk_metadata"):
        assert "num_audio_samples" not in message and "audio_sample_rate" not in message
    assert decode_audio(silent.video_bytes) is None
    with_sound = await running.run_session(START)  # left out: the engine's way, with sound
    assert decode_audio(with_sound.video_bytes) is not None
    assert [m["num_frames"] for m in media_of(silent)] == [
        m["num_frames"] for m in media_of(with_sound)
    ]
    np.testing.assert_array_equal(
        np.stack(decode_video(silent.video_bytes)), np.stack(decode_video(with_sound.video_bytes))
    )


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"generate_sound": True}, "generate_sound"),
        ({"sound_duration": 17 / 7}, "sound_duration"),
        ({"generate_sound": True, "sound_duration": 17 / 7}, "generate_sound"),
    ],
)
async def test_sound_from_an_engine_without_sound_is_refused_with_a_code(
    start_server: Any, fields: dict[str, Any], named: str
) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=3))
    transcript = await running.run_session({**START, **fields})
    (error,) = transcript.terminal
    assert error["type"] == "error" and error["code"] == "invalid_request"
    assert f"{named} is not supported by " in error["message"]
    assert error["message"].endswith("it makes no sound")
    assert not transcript.of_type("video.start")
    # generate_sound false asks for nothing it cannot do.
    plain = await running.run_session({**START, "generate_sound": False})
    assert plain.terminal[-1]["type"] == "session.done"


async def test_a_sound_duration_other_than_the_videos_is_refused(start_server: Any) -> None:
    running = await start_server(SOUND)
    transcript = await running.run_session({**START, "generate_sound": True, "sound_duration": 5})
    (error,) = transcript.terminal
    assert error["code"] == "invalid_request"
    assert "sound_duration must be the video's duration" in error["message"]

"""The AAC track beside H.264: declared in the init segment, in every media chunk, and in
sync to the sample however long the stream (`trio_vstream.media.aac`, module docstring).

Every check decodes with PyAV (FFmpeg), honouring the container's timing as a player
does (`trio_vstream.client._mp4.decode_audio`): what matters is what comes out.
"""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest

from tests.media.test_encoding import _boxes, _child
from trio_vstream.client._mp4 import decode_audio
from trio_vstream.engines.contract import EngineError
from trio_vstream.engines.frames import audio_to_float32_array
from trio_vstream.media.aac import AUDIO_CODEC_STRING
from trio_vstream.media.encoding import EncodingError, FragmentedMP4Encoder
from trio_vstream.media.fmp4 import fragment_starts_with_keyframe
from trio_vstream.media.remux import remux_to_mp4
from trio_vstream.values import audio_samples_through

TONE = 440


def tone(begin: int, end: int, rate: int, channels: int = 1) -> np.ndarray:
    """Samples begin..end of a half-scale sine, the same on every channel."""
    n = np.arange(begin, end)
    wave = (0.5 * np.sin(2 * np.pi * TONE * n / rate)).astype(np.float32)
    return np.repeat(wave[None, :], channels, axis=0)


def encode_stream(
    *, rate: int, fps: int, chunks: list[int], channels: int = 1, size: int = 16
) -> list[bytes]:
    """Each chunk's bytes, then the trailer: a tone across chunks of these frame counts."""
    encoder = FragmentedMP4Encoder(
        width=size, height=size, fps=fps, audio_sample_rate=rate, audio_channels=channels
    )
    out = []
    done = 0
    for count in chunks:
        begin = audio_samples_through(done, rate, fps)
        end = audio_samples_through(done + count, rate, fps)
        assert encoder.audio_samples_for(count) == end - begin
        frames = np.full((count, size, size, 3), 128, np.uint8)
        out.append(encoder.encode(frames, audio=tone(begin, end, rate, channels)))
        done += count
    out.append(encoder.close())
    return out


def phase_at(pcm: np.ndarray, start: int, rate: int) -> float:
    """The tone's phase (radians) over one second from ``start``, against the ideal sine."""
    seg = pcm[start : start + rate]
    n = np.arange(start, start + len(seg))
    return float(np.angle(np.sum(seg * np.exp(-2j * np.pi * TONE * n / rate))))


def test_samples_through_rounds_cumulatively_and_exactly() -> None:
    assert audio_samples_through(0, 48000, 24) == 0
    assert audio_samples_through(1, 48000, 24) == 2000
    assert audio_samples_through(1, 8000, 7) == 1143  # 1142.857 rounds up
    assert audio_samples_through(7, 8000, 7) == 8000
    assert audio_samples_through(1, 44100, 16) == 2756  # 2756.25 rounds down
    assert audio_samples_through(2, 8000, 3) == 5333  # 5333.33
    assert audio_samples_through(1, 3, 2) == 2  # 1.5: half rounds up
    # No float anywhere: exact after a year of 7 fps.
    frames = 7 * 3600 * 24 * 365
    assert audio_samples_through(frames, 8000, 7) == 8000 * 3600 * 24 * 365


def test_init_segment_declares_h264_and_aac_and_every_chunk_carries_both() -> None:
    chunks = encode_stream(rate=48000, fps=24, chunks=[8, 8, 3, 8])
    boxes = _boxes(chunks[0])
    moov = next(body for kind, body in boxes if kind == b"moov")
    traks = [body for kind, body in _boxes(moov) if kind == b"trak"]
    handlers = [_child(_child(trak, b"mdia"), b"hdlr")[8:12] for trak in traks]
    assert handlers == [b"vide", b"soun"]
    mvex = _child(moov, b"mvex")
    assert [kind for kind, _ in _boxes(mvex)] == [b"trex", b"trex"]
    for data in chunks[:-1]:
        moof = next(body for kind, body in _boxes(data) if kind == b"moof")
        trafs = [body for kind, body in _boxes(moof) if kind == b"traf"]
        track_ids = [int.from_bytes(_child(traf, b"tfhd")[4:8], "big") for traf in trafs]
        assert track_ids == [1, 2], "each media chunk: video then audio"
        assert fragment_starts_with_keyframe(data)
    with av.open(io.BytesIO(chunks[0]), mode="r") as container:
        assert len(container.streams.video) == 1
        (audio,) = container.streams.audio
        assert audio.codec_context.name == "aac"
        assert audio.codec_context.sample_rate == 48000
    assert AUDIO_CODEC_STRING == "mp4a.40.2"


@pytest.mark.parametrize(("rate", "fps", "channels"), [(48000, 24, 1), (44100, 16, 2)])
def test_joined_stream_decodes_to_exactly_the_pcm(rate: int, fps: int, channels: int) -> None:
    sizes = [5, 1, 8, 3, 7, 2]
    decoded = decode_audio(
        b"".join(encode_stream(rate=rate, fps=fps, chunks=sizes, channels=channels))
    )
    assert decoded is not None
    pcm_rate, pcm = decoded
    total = audio_samples_through(sum(sizes), rate, fps)
    assert pcm_rate == rate
    assert pcm.shape == (channels, total)
    expected = tone(0, total, rate, channels)
    # Lossy, but the same sine, from the first sample (no priming left, no shift).
    for channel in range(channels):
        assert np.corrcoef(pcm[channel], expected[channel])[0, 1] > 0.99
    assert abs(phase_at(pcm[0], 0, rate) - phase_at(expected[0], 0, rate)) < 0.01


@pytest.mark.slow
def test_ten_minutes_of_chunks_drift_by_zero_samples() -> None:
    """10 minutes at 7 fps, 3-frame chunks, 8 kHz: 8000/7 samples a frame is no whole
    number, so every chunk rounds; the total still comes out exact, and the tone's phase
    at the end is its phase at the start."""
    rate, fps, frames = 8000, 7, 7 * 600
    chunks = encode_stream(rate=rate, fps=fps, chunks=[3] * (frames // 3), size=16)
    decoded = decode_audio(b"".join(chunks))
    assert decoded is not None
    _, pcm = decoded
    assert pcm.shape == (1, frames * rate // fps) == (1, 4_800_000)
    start, middle, end = (phase_at(pcm[0], at, rate) for at in (0, 2_400_000, 4_800_000 - rate))
    # A drift of one sample at 440 Hz and 8 kHz would turn the phase by 0.35 radians.
    assert abs(middle - start) < 0.02
    assert abs(end - start) < 0.02


def test_saved_mp4_keeps_the_sound(tmp_path: Path) -> None:
    rate, fps, sizes = 48000, 24, [8, 8, 8]
    data = b"".join(encode_stream(rate=rate, fps=fps, chunks=sizes))
    frames = remux_to_mp4(data, tmp_path / "out.mp4")
    assert frames == 24
    with av.open(str(tmp_path / "out.mp4")) as container:
        assert [s.type for s in container.streams] == ["video", "audio"]
    decoded = decode_audio((tmp_path / "out.mp4").read_bytes())
    assert decoded is not None
    total = audio_samples_through(24, rate, fps)
    # The progressive file's last AAC frame may keep a few samples of its padding.
    assert total <= decoded[1].shape[1] < total + 1024
    assert np.corrcoef(decoded[1][0, :total], tone(0, total, rate)[0])[0, 1] > 0.99


def test_a_stream_without_sound_has_one_track() -> None:
    encoder = FragmentedMP4Encoder(width=16, height=16, fps=24)
    data = encoder.encode(np.zeros((2, 16, 16, 3), np.uint8)) + encoder.close()
    assert decode_audio(data) is None
    with pytest.raises(EncodingError, match="without an audio track"):
        FragmentedMP4Encoder(width=16, height=16, fps=24).encode(
            np.zeros((2, 16, 16, 3), np.uint8), audio=np.zeros((1, 4000), np.float32)
        )


def test_audio_of_the_wrong_length_is_refused_before_anything_is_encoded() -> None:
    encoder = FragmentedMP4Encoder(width=16, height=16, fps=24, audio_sample_rate=48000)
    frames = np.zeros((2, 16, 16, 3), np.uint8)
    for bad in (np.zeros((1, 3999), np.float32), np.zeros((2, 4000), np.float32), None):
        with pytest.raises(EncodingError, match="expected the chunk's audio"):
            encoder.encode(frames, audio=bad)
    assert encoder.frames_encoded == 0
    encoder.encode(frames, audio=np.zeros((1, 4000), np.float32))  # still usable


@pytest.mark.parametrize(
    ("rate", "channels", "match"),
    [(96000, 1, "audio_sample_rate"), (22000, 1, "audio_sample_rate"), (48000, 3, "channels")],
)
def test_a_format_aac_cannot_carry_is_refused(rate: int, channels: int, match: str) -> None:
    with pytest.raises(EncodingError, match=match):
        FragmentedMP4Encoder(
            width=16, height=16, fps=24, audio_sample_rate=rate, audio_channels=channels
        )


def test_engine_audio_is_brought_to_float32_or_refused() -> None:
    mono = audio_to_float32_array(np.full(10, 2.0), channels=1, samples=10)
    assert mono.shape == (1, 10) and mono.dtype == np.float32 and mono.max() == 1.0
    engine_array = np.full((1, 10), 3.0, np.float32)
    audio_to_float32_array(engine_array, channels=1, samples=10)
    assert engine_array.max() == 3.0, "the engine's own array is not clipped in place"
    with pytest.raises(EngineError, match="9 audio samples"):
        audio_to_float32_array(np.zeros(9, np.float32), channels=1, samples=10)
    with pytest.raises(EngineError, match="shape"):
        audio_to_float32_array(np.zeros((2, 10), np.float32), channels=1, samples=10)
    with pytest.raises(EngineError, match="shape"):
        audio_to_float32_array(np.zeros(10, np.int16), channels=1, samples=10)
    with pytest.raises(EngineError, match="not finite"):
        audio_to_float32_array(np.full(10, np.nan, np.float32), channels=1, samples=10)
    with pytest.raises(EngineError, match="without audio"):
        audio_to_float32_array(None, channels=1, samples=10)


def test_a_torch_tensor_of_any_float_type_is_taken() -> None:
    """A vocoder's output: a (channels, samples) bf16 tensor (on a GPU, in a real model)."""
    torch = pytest.importorskip("torch")
    wave = torch.linspace(-0.5, 0.5, 20).reshape(2, 10).to(torch.bfloat16)
    audio = audio_to_float32_array(wave, channels=2, samples=10)
    assert audio.shape == (2, 10) and audio.dtype == np.float32
    np.testing.assert_allclose(audio, wave.float().numpy())

"""The audio rule: an engine with sound carries, in each chunk, exactly its frames'
samples.

Checked on the full run's chunks (`_chunks`), which have the frames to count; the
declared format itself is read, and checked, by the interface rule (`_interface`).
"""

from __future__ import annotations

from trio_vstream.engines.contract import EngineError
from trio_vstream.engines.frames import audio_to_float32_array
from trio_vstream.engines.interfaces import AudioFormat
from trio_vstream.engines.testing._kit import Kit, Run
from trio_vstream.values import audio_samples_through


def check_audio(kit: Kit, run: Run, sound: AudioFormat) -> None:
    """Each chunk's sound is exactly as long as its frames (cumulative rounding)."""
    done = 0
    fps = kit.request.fps
    for index, (chunk, frames) in enumerate(zip(run.chunks, run.frames, strict=True)):
        begin = audio_samples_through(done, sound.sample_rate, fps)
        done += len(frames)
        samples = audio_samples_through(done, sound.sample_rate, fps) - begin
        try:
            audio_to_float32_array(chunk.audio, channels=sound.channels, samples=samples)
        except EngineError as exc:
            kit.fail("audio", f"chunk {index}: {exc}", once="audio")

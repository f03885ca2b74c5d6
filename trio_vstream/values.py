"""Plain values about a video that both the wire protocol and the engines speak of.

A module of its own so that each depends on it and neither on the other: the
protocol resolves a request against an engine's defaults without knowing
engines, and an engine states its defaults without knowing the wire.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class VideoDefaults:
    """An engine's defaults, used where a request leaves a video setting out."""

    width: int = 256
    height: int = 256
    fps: int = 24
    num_frames: int = 48


#: The camera modes of vllm-omni's interactive world models: ``velocity`` is a motion
#: per generation step, ``target`` a pose to move to.
CAMERA_MODES: frozenset[str] = frozenset({"velocity", "target"})


@attrs.frozen
class Camera:
    """A camera in a ``session.interaction``, in Unity's axes (+X right, +Y up, +Z forward).

    Turns have vllm-omni's sense, which is not Unity's left-handed one for pitch: a
    positive turn about +Y looks right, a positive turn about +X looks up. vllm-omni's
    example client sends +4 degrees about X for its ``i`` key (look up), and its server
    applies the quaternion as it is to LingBot's OpenCV camera poses (+Y down), where
    that turn looks up; a client of vllm-omni steers the same way here.

    Here, not in the protocol, because the protocol parses it and an engine acts on it:
    one type both speak, already validated (finite numbers, a unit quaternion, a known
    mode), so an engine never has to re-check the client's numbers.
    """

    mode: str
    """One of `CAMERA_MODES`."""
    translation: tuple[float, float, float]
    """(x, y, z): a per-step motion (``velocity``) or a position (``target``)."""
    rotation: tuple[float, float, float, float]
    """(qx, qy, qz, qw): a unit quaternion, the same two readings as ``translation``."""


AUDIO_SAMPLE_RATES: frozenset[int] = frozenset(
    {8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000}
)
"""The sample rates an engine's audio may have: AAC's, up to 48 kHz (an MP4 sample entry
holds the rate in 16 bits, and the page's browsers all play these)."""

AUDIO_MAX_CHANNELS = 2
"""Mono or stereo."""


def audio_samples_through(frames: int, sample_rate: int, fps: int) -> int:
    """How many audio samples cover a video's first ``frames`` frames: ``frames * rate /
    fps`` rounded half up, in integers (no float error, however long the stream).

    Why cumulative: a chunk's audio is ``audio_samples_through(end) -
    audio_samples_through(start)`` samples, so the per-chunk roundings never add up;
    after any number of chunks the audio is off the video by less than one sample.
    """
    return (2 * frames * sample_rate + fps) // (2 * fps)

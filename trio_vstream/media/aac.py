"""AAC-LC through FFmpeg's own encoder (PyAV): PCM in, whole coded frames out, in step.

A thin adapter for `trio_vstream.media.encoding`'s audio track. Each chunk's PCM covers
exactly its video frames (`trio_vstream.values.audio_samples_through`), but AAC codes
1024-sample frames and its encoder holds one back, so a FIFO keeps the samples that do
not fill a frame yet and the packets come out a frame or two behind: a fragment carries
the audio encoded so far, and its timestamps say where it belongs
(`trio_vstream.media.fmp4`). The encoder's priming (1024 samples of silence before the
first real one) is cut by the track's edit list (`AAC_PRIMING`), and the last call
(``final``) codes what is left in the FIFO as a short last frame whose sample duration is
the real count: the joined stream decodes to exactly the PCM the engine returned, no
sample more or less. Every packet's timestamp is checked against where the track is, so
the sound cannot drift from the video unnoticed.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Final

import av
import av.error
import numpy as np

from trio_vstream.media.errors import EncodingError
from trio_vstream.media.fmp4 import AudioSample, AudioTrack
from trio_vstream.values import AUDIO_MAX_CHANNELS, AUDIO_SAMPLE_RATES

__all__ = ["AAC_FRAME", "AAC_PRIMING", "AUDIO_CODEC_STRING", "AacEncoder"]

AAC_FRAME: Final = 1024
"""Samples in one AAC-LC frame (one MP4 sample)."""
AAC_PRIMING: Final = 1024
"""Samples of priming FFmpeg's AAC encoder puts before the first real one (its
``initial_padding``): the first packet's pts is -1024, which `AacEncoder.encode` checks."""
AUDIO_CODEC_STRING: Final = "mp4a.40.2"
"""RFC 6381 codecs value of the audio track (AAC-LC), for MSE ``addSourceBuffer``."""


class AacEncoder:
    """One AAC-LC encoder and its FIFO; checks ``rate`` and ``channels`` first."""

    def __init__(self, rate: int, channels: int) -> None:
        if isinstance(rate, bool) or not isinstance(rate, int) or rate not in AUDIO_SAMPLE_RATES:
            raise EncodingError(
                f"audio_sample_rate must be one of {sorted(AUDIO_SAMPLE_RATES)}, got {rate!r}"
            )
        if isinstance(channels, bool) or channels not in range(1, AUDIO_MAX_CHANNELS + 1):
            raise EncodingError(f"audio_channels must be 1 or 2, got {channels!r}")
        try:
            actx = av.CodecContext.create("aac", "w")
            assert isinstance(actx, av.AudioCodecContext)
            actx.sample_rate = rate
            actx.layout = "mono" if channels == 1 else "stereo"
            actx.format = "fltp"
            actx.time_base = Fraction(1, rate)
            actx.bit_rate = 64000 * channels
            actx.open()
        except (av.error.FFmpegError, ValueError) as exc:
            raise EncodingError(f"the AAC encoder could not be opened: {exc}") from exc
        if actx.frame_size != AAC_FRAME or not actx.extradata:
            raise EncodingError("the AAC encoder is not the AAC-LC one this muxer expects")
        self._ctx = actx
        self._rate = rate
        self._channels = channels
        self._fifo = np.zeros((channels, 0), dtype=np.float32)
        self._fed = 0  # samples handed to the AAC encoder
        self._written = 0  # track time of the next AAC sample (priming included)

    @property
    def track(self) -> AudioTrack:
        """The track's description for the init segment."""
        return AudioTrack(
            sample_rate=self._rate,
            channels=self._channels,
            audio_specific_config=bytes(self._ctx.extradata or b""),
            bit_rate=self._ctx.bit_rate or 0,
            frame_samples=AAC_FRAME,
            priming=AAC_PRIMING,
        )

    @property
    def samples_written(self) -> int:
        """Track time (priming included) just after the last sample `encode` returned."""
        return self._written

    def encode(self, pcm: np.ndarray | None, *, final: bool) -> list[AudioSample]:
        """Add ``pcm`` ((channels, n) float32) to the FIFO and code its whole AAC frames
        (and, ``final``, its rest, then flush the encoder); the coded frames the track has
        not had yet, in order."""
        actx = self._ctx
        if pcm is not None:
            self._fifo = np.concatenate([self._fifo, pcm], axis=1)
        fifo = self._fifo
        usable = fifo.shape[1] if final else fifo.shape[1] - fifo.shape[1] % AAC_FRAME
        packets: list[av.Packet] = []
        try:
            for begin in range(0, usable, AAC_FRAME):
                block = np.ascontiguousarray(fifo[:, begin : min(begin + AAC_FRAME, usable)])
                frame = av.AudioFrame.from_ndarray(block, format="fltp", layout=actx.layout.name)
                frame.sample_rate = self._rate
                frame.pts = self._fed
                self._fed += block.shape[1]
                packets.extend(actx.encode(frame))
            if final:
                packets.extend(actx.encode(None))
        except (av.error.FFmpegError, ValueError, MemoryError) as exc:
            raise EncodingError(f"the AAC encoder failed: {exc}") from exc
        self._fifo = fifo[:, usable:]
        samples = []
        for packet in packets:
            # Where the track is: priming first, then the engine's samples, in order.
            if packet.pts is None or packet.pts + AAC_PRIMING != self._written:
                raise EncodingError(
                    f"the AAC encoder put a packet at {packet.pts}, not at "
                    f"{self._written - AAC_PRIMING}: the audio would drift"
                )
            duration = int(packet.duration or AAC_FRAME)
            self._written += duration
            samples.append(AudioSample(bytes(packet), duration))
        return samples

"""LTX-2 (``LTX2Pipeline``, ``LTX2ImageToVideoPipeline``): the segment path, with sound.

LTX-2 makes a clip's picture and its soundtrack in one call: one transformer denoises
video and audio latents together, and after the VAE decode, the audio VAE decodes a mel
spectrogram that the vocoder turns into a waveform (``output.audio``, 24 kHz stereo for
the released vocoder). So it streams as any whole-clip pipeline does (`segments`): one
call a segment, the later ones continued from the previous segment's last frame through
``LTX2ImageToVideoPipeline`` (``i2v_model``, or the model itself when it is that one),
stopped between steps, a prompt change taking effect from the next segment. What this
family adds is the sound: the engine declares it (`SoundLoop`: the vocoder's
``output_sampling_rate`` and channel count), and each chunk carries the waveform of its
own frames.

How a segment's waveform becomes its chunk's audio (`segment_audio`). A chunk must carry
exactly ``audio_samples_through(end) - audio_samples_through(start)`` samples
(`trio_vstream.values`); the vocoder's waveform is close to the call's length but never
exactly it: the pipeline sizes its audio latents as ``round(seconds * latents per
second)``, and the causal audio VAE decodes ``L`` latents into ``4L - 3`` mel frames, so
the waveform comes out a little short, about 30 to 45 ms for the released model. The
waveform starts with the call's first frame, so:

- the audio of the frames sent is the waveform from the first kept frame on: a segment
  continued from the last frame drops that frame's ``audio_samples_through(1)`` samples
  with the frame (its copy of the previous segment's last frame, re-made; its sound was
  sent with the previous segment), then takes the count the chunk needs;
- where the waveform falls short of that count, the missing tail is filled by mirroring
  the waveform's end (``numpy.pad``'s ``reflect``), so a segment boundary has no gap of
  silence and no click; where it is longer (the last segment, cut to the video's end),
  the rest is dropped.

Each segment's soundtrack is made with its picture, from the prompt: LTX-2's image-to-
video call takes no audio to continue from, so the sound is not continuous across a
segment boundary (a seam where the picture continues). Longer segments
(``segment_frames``) make fewer seams.

Arguments: ``frame_rate`` is the request's ``fps`` (which also sets how long the
soundtrack is), ``num_frames`` is ``8n+1`` and the size a multiple of 32 for the released
model (the engine reads both from the pipeline). ``extra_params`` takes LTX-2's guidance
knobs (video and audio: CFG, spatio-temporal guidance and its blocks, modality
isolation, their rescales), ``use_cross_timestep``, the decode noise, ``noise_scale``,
``motion_speed`` and, for the image-to-video pipeline, ``image_crf`` (the H.264
re-compression its conditioning image gets, as in training: 33 by default; 0 turns it
off). Refused: ``audio_latents`` (the call's own noise, as ``latents``),
``min_seconds``/``max_seconds`` (the duration head's range: the engine sets
``num_frames``), and the prompt enhancer's arguments (text generation on the shared
encoder, and the engine hands the call embeddings, not text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from trio_vstream.engines.contract import Chunk, EngineError
from trio_vstream.engines.diffusers._extra import (
    COMMON,
    ExtraParams,
    Refused,
    flag,
    number,
    whole,
)
from trio_vstream.engines.diffusers._messages import shown
from trio_vstream.engines.diffusers._settings import config_error
from trio_vstream.engines.diffusers.loops._protocol import Loop, SoundLoop
from trio_vstream.engines.diffusers.loops.segments import SegmentPlan, SegmentRun, Segments
from trio_vstream.engines.interfaces import AudioFormat
from trio_vstream.values import AUDIO_MAX_CHANNELS, AUDIO_SAMPLE_RATES, audio_samples_through

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo
    from trio_vstream.engines.diffusers._stream import DiffusersStream
    from trio_vstream.engines.transitions import ChunkConditioning

GUIDANCE = number(0, 20)
"""A guidance scale: the protocol's bound on ``guidance_scale``."""


def stg_blocks(key: str, value: Any, used: Sequence[PipelineInfo]) -> list[int]:
    """``spatio_temporal_guidance_blocks``: distinct transformer block indices, at least
    one (the call refuses spatio-temporal guidance without any), each below the
    transformer's depth."""
    depth = min(_depth(info) for info in used)
    if (
        not isinstance(value, list)
        or not 1 <= len(value) <= depth
        or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < depth for v in value)
        or len(set(value)) != len(value)
    ):
        raise Refused(
            f"extra_params.{key} must be a list of 1 to {depth} distinct block indices "
            f"from 0 to {depth - 1}, got {shown(value)}"
        )
    return list(value)


EXTRA_PARAMS = ExtraParams(
    "LTX-2",
    {
        **COMMON,
        "stg_scale": GUIDANCE,
        "modality_scale": GUIDANCE,
        "guidance_rescale": number(0, 1),
        "audio_guidance_scale": GUIDANCE,
        "audio_stg_scale": GUIDANCE,
        "audio_modality_scale": GUIDANCE,
        "audio_guidance_rescale": number(0, 1),
        "spatio_temporal_guidance_blocks": stg_blocks,
        "use_cross_timestep": flag,
        "decode_timestep": number(0, 1),
        "decode_noise_scale": number(0, 1),
        "noise_scale": number(0, 1),
        "motion_speed": number(0.1, 10),
        "image_crf": whole(0, 51),  # H.264's CRF range
    },
)
"""LTX-2's own knobs, each bounded (see the module docstring for what is refused)."""


class LTX2Segments(Segments):
    """LTX-2 (`Loop`, `SoundLoop`): the segment path, each chunk with its soundtrack."""

    name = "LTX-2 segments"
    batches = False
    """Its calls run alone under the lock (its transformer is not one `_calls` batches)."""
    engine_set: tuple[str, ...] = ("audio_latents", "min_seconds", "max_seconds")

    def recognises(self, info: PipelineInfo) -> bool:
        """A pipeline whose call denoises audio latents beside the video's, and which has
        the audio VAE and vocoder that make them a waveform."""
        return "audio_latents" in info.params and all(
            getattr(info.pipe, part, None) is not None for part in ("audio_vae", "vocoder")
        )

    def extra_params(self, model: PipelineInfo) -> ExtraParams:
        return EXTRA_PARAMS

    def audio_format(self, model: PipelineInfo, i2v: PipelineInfo | None) -> AudioFormat:
        sound = _sound_of(model)
        if i2v is not None and i2v is not model:
            if not self.recognises(i2v):
                raise config_error(
                    f"i2v_model: {i2v.class_name} makes no sound, and {model.class_name}'s "
                    "segments continue with theirs: give LTX2ImageToVideoPipeline"
                )
            other = _sound_of(i2v)
            if other != sound:
                raise config_error(
                    f"i2v_model: {i2v.class_name}'s sound ({other.sample_rate} Hz, "
                    f"{other.channels} channels) differs from {model.class_name}'s "
                    f"({sound.sample_rate} Hz, {sound.channels} channels)"
                )
        return sound

    def start(self, stream: DiffusersStream, plan: SegmentPlan) -> LTX2Run:
        return LTX2Run(stream, plan)


LOOP: Loop[SegmentPlan] = LTX2Segments()

if TYPE_CHECKING:
    _SOUND: SoundLoop = LTX2Segments()  # checked: the family declares its sound


class LTX2Run(SegmentRun):
    """One session's segments, each chunk with the audio of its frames (`segment_audio`)."""

    def __init__(self, stream: DiffusersStream, plan: SegmentPlan) -> None:
        super().__init__(stream, plan)
        rate = stream.engine.audio_sample_rate
        assert rate is not None  # the engine declares LTX-2's sound (`SoundLoop`)
        self._format = AudioFormat(rate, stream.engine.audio_channels)
        self._fps = stream.request.fps
        self._sent = 0
        """Frames sent so far: where the next chunk's audio starts in the stream."""
        self._wave: Any = None
        """The last call's waveform, on its device, until its chunk takes its samples."""

    def close(self) -> None:
        super().close()
        self._wave = None

    def _video(self, output: Any) -> Any:
        wave = getattr(output, "audio", None)
        if wave is None and isinstance(output, tuple) and len(output) > 1:
            wave = output[1]
        if wave is None:
            raise EngineError("the LTX-2 call returned no audio")
        self._wave = wave
        return super()._video(output)

    def _chunk(
        self,
        stream: DiffusersStream,
        host: np.ndarray,
        conditioning: ChunkConditioning,
        index: int,
        continuing: bool,
    ) -> Chunk:
        wave, self._wave = self._wave, None
        pcm = wave.detach()[0].float().cpu().numpy()  # the chunk's one host copy of sound
        del wave
        if pcm.ndim != 2 or pcm.shape[0] != self._format.channels:
            raise EngineError(
                f"the vocoder made audio of shape {pcm.shape}, not {self._format.channels} channels"
            )
        audio = segment_audio(
            pcm,
            rate=self._format.sample_rate,
            fps=self._fps,
            dropped=1 if continuing else 0,
            first=self._sent,
            frames=host.shape[0],
        )
        self._sent += host.shape[0]
        return attrs.evolve(stream.chunk(host, conditioning, index), audio=audio)


def segment_audio(
    wave: np.ndarray, *, rate: int, fps: int, dropped: int, first: int, frames: int
) -> np.ndarray:
    """The chunk's audio from its call's waveform ``wave`` (channels, samples), which
    starts with the call's first frame: the ``dropped`` frames' samples left out, then
    exactly the samples of stream frames ``first`` .. ``first + frames``, the waveform's
    end mirrored where it falls short (see the module docstring)."""
    begin = audio_samples_through(dropped, rate, fps)
    need = audio_samples_through(first + frames, rate, fps) - audio_samples_through(
        first, rate, fps
    )
    piece = wave[:, begin : begin + need]
    short = need - piece.shape[1]
    if short > 0:
        if piece.shape[1] >= 2:
            piece = np.pad(piece, ((0, 0), (0, short)), mode="reflect")
        else:  # nothing to mirror
            piece = np.pad(piece, ((0, 0), (0, short)))
    return np.ascontiguousarray(piece, dtype=np.float32)


def _sound_of(info: PipelineInfo) -> AudioFormat:
    """The sample rate and channels of ``info``'s vocoder, checked against what the
    stream can carry (AAC's rates, mono or stereo)."""
    config = getattr(getattr(info.pipe, "vocoder", None), "config", None)
    rate = getattr(config, "output_sampling_rate", None)
    channels = getattr(config, "out_channels", None)
    where = f"{info.role}: {info.class_name}"
    if not isinstance(rate, int) or rate not in AUDIO_SAMPLE_RATES:
        raise config_error(
            f"{where}: its vocoder's output_sampling_rate {rate!r} is not one the stream "
            f"carries ({', '.join(str(r) for r in sorted(AUDIO_SAMPLE_RATES))})"
        )
    if not isinstance(channels, int) or not 1 <= channels <= AUDIO_MAX_CHANNELS:
        raise config_error(f"{where}: its vocoder makes {channels!r} channels, not 1 or 2")
    return AudioFormat(rate, channels)


def _depth(info: PipelineInfo) -> int:
    """The transformer's number of blocks (1 where it cannot be read)."""
    config = getattr(getattr(info.pipe, "transformer", None), "config", None)
    layers = getattr(config, "num_layers", None)
    return layers if isinstance(layers, int) and layers > 0 else 1

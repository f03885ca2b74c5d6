"""A valid ``session.start``, turned into what the engine is asked and what the client
is told back.

The protocol validates a request (`protocol.SessionStart`); the engine takes a
`GenerationRequest`. Between the two, the server keeps for itself the ``extra_params``
it applies (codec options, pacing, scripts: `SERVER_PARAMS`), hands the engine the
rest, and fills the video's geometry as resolved against the engine's defaults. The
``video.start`` echo of the request then says which seed the engine chose, when the
client chose none, so that a video can be made again.

Pure: no Trio, no I/O. Decoding the image, opening the encoder and the engine's stream
are the session's (`trio_vstream.session.session`); this is what they are given.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from trio_vstream import protocol
from trio_vstream.engines.contract import GenerationRequest, SamplingSettings, VideoInput

SERVER_PARAMS: Final = frozenset(
    {
        protocol.CODEC_OPTIONS_PARAM,  # checked: SessionStart.codec_options
        *protocol.PACING_PARAMS,  # the server paces, never the engine
        protocol.CAMERA_SCRIPT_PARAM,  # the server feeds it, chunk by chunk
        protocol.INTERACTION_SCRIPT_PARAM,  # and this one
    }
)
"""The ``extra_params`` keys the server applies itself: an engine never sees them."""


def engine_extra_params(start: protocol.SessionStart) -> dict[str, Any]:
    """The request's ``extra_params`` that are the engine's: all but `SERVER_PARAMS`."""
    extra = start.request.extra_params or {}
    return {key: value for key, value in extra.items() if key not in SERVER_PARAMS}


def generation_request(
    start: protocol.SessionStart, request_id: str, image: np.ndarray | None = None
) -> GenerationRequest:
    """What the engine is asked for a valid ``session.start``.

    ``image`` is the request's ``image_reference``, decoded (the session decodes it off
    the event loop). Every field of `GenerationRequest` is filled from the start: the
    geometry as resolved (`protocol.VideoSettings`), the sampling settings as sent
    (None: the engine's default), ``extra_params`` less the server's own.
    """
    request = start.request
    video = start.video
    return GenerationRequest(
        request_id=request_id,
        prompt=request.prompt,
        width=video.width,
        height=video.height,
        fps=video.fps,
        num_frames=video.num_frames,
        negative_prompt=request.negative_prompt,
        num_inference_steps=request.num_inference_steps,
        guidance_scale=request.guidance_scale,
        sampling=SamplingSettings(
            guidance_scale_2=request.guidance_scale_2,
            true_cfg_scale=request.true_cfg_scale,
            boundary_ratio=request.boundary_ratio,
            flow_shift=request.flow_shift,
        ),
        seed=request.seed,
        quality=request.quality,
        image=image,
        lora=request.lora,
        extra_params=engine_extra_params(start),
        input_video=(
            VideoInput(fps=start.input_video.fps, strength=start.input_video.strength)
            if start.input_video is not None
            else None
        ),
    )


def config_echo(
    start: protocol.SessionStart, engine_seed: object, audio: tuple[int, int] | None = None
) -> dict[str, Any]:
    """The request as used, for ``video.start``: with the engine's seed (``engine_seed``,
    what its stream says it drew) when the client chose none, and, for a stream with
    sound (``audio``: its sample rate and channels), an ``audio`` entry saying so
    (`protocol.audio_config`): a client or page learns it before the first chunk.

    Only a whole number is a seed: anything else the stream holds (None, a bool) is not
    echoed, and neither is it over the client's own choice.
    """
    config = start.config
    if audio is not None:
        config = {**config, "audio": protocol.audio_config(*audio)}
    if "seed" in config or not isinstance(engine_seed, int) or isinstance(engine_seed, bool):
        return config
    return {**config, "seed": engine_seed}

"""A session's way to its ``video.start``: the first message, then every check and every
resource the video needs, each failure a coded error before anything is streamed.

`receive_start` waits for the ``session.start`` (within the start timeout) and parses it;
`prepare` then, in this order, takes the request's scripts, fetches and decodes its image
(under the server's image limiter), opens the encoder with the checked codec options and
opens the engine's stream (with the stall timeout as its deadline: the stall guard only
starts with the video). A failure is a `StartFailure`, which the session turns into its
``error`` message; the outcomes that are not failures (a client gone, a refused
``session.start``, an engine too slow to open) are recorded on the session's `Ending`
where they happen, as the first reason wins.

The session keeps its state: these take what they need as arguments and return what it
keeps. The one exception is the encoder, handed over (``keep_encoder``) the moment it
exists, so that a failure after it (the engine's stream) still leaves it to the session
to close.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from trio_vstream import protocol
from trio_vstream.engines.contract import Engine, GenerationRequest, InvalidRequestError
from trio_vstream.engines.interfaces import (
    AudioFormat,
    FollowsInput,
    audio_format,
    interaction_kinds,
    missing_members,
    supports_video_input,
)
from trio_vstream.logsafe import get_logger
from trio_vstream.media.encoding import EncodingError, FragmentedMP4Encoder
from trio_vstream.media.image_decode import decode_image
from trio_vstream.media.image_fetch import ImageFetchError, fetch_image
from trio_vstream.protocol import ErrorCode
from trio_vstream.session.calls import SessionCalls
from trio_vstream.session.endings import Ending, Outcome, SessionError, engine_failure
from trio_vstream.session.interaction_queue import InteractionQueue
from trio_vstream.session.pacing import Pacer, PlaybackGate
from trio_vstream.session.request import generation_request
from trio_vstream.session.resources import ServerResources
from trio_vstream.session.scripts import ScriptRefused, Scripts

# The session's logger: these are its lines, under the name they had in `session`.
logger = get_logger("trio_vstream.session.session")

STALLED_OPENING: SessionError = (ErrorCode.STALL_TIMEOUT, "Stall timeout: no generation progress")
"""An engine that does not open its stream within the stall timeout (the reference's words)."""


class StartFailure(Exception):
    """Ends the session with an ``error`` message (a request or engine problem)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid_start(detail: object) -> StartFailure:
    """The failure of a ``session.start`` that parsed but cannot be served as asked."""
    return StartFailure(ErrorCode.INVALID_REQUEST, f"Invalid session.start: {detail}")


def first_failure(group: BaseExceptionGroup[StartFailure]) -> StartFailure:
    """The first exception of a (possibly nested) group: the one the client is told of."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    assert isinstance(first, StartFailure)
    return first


@attrs.frozen
class Prepared:
    """What a prepared session keeps (its encoder, already handed over, aside)."""

    request: GenerationRequest
    scripts: Scripts
    pacer: Pacer | None
    gate: PlaybackGate | None = None
    """Set when the client asked for ``streaming_buffer_seconds``
    (`trio_vstream.session.pacing`)."""
    queue: InteractionQueue = attrs.Factory(InteractionQueue)
    """Its pending interactions; held for their action windows in a paced camera session."""


async def receive_start(
    ws: WebSocketConnection, resources: ServerResources, ending: Ending
) -> tuple[protocol.SessionStart, float] | None:
    """The ``session.start`` and ``trio.current_time()`` when it came; None when the
    session ends here (a client gone, a ``session.start`` refused: recorded on ``ending``).
    Raises `StartFailure` when none comes within the start timeout."""
    config = resources.config
    with trio.move_on_after(config.start_timeout) as timeout:
        try:
            raw = await ws.get_message()
        except ConnectionClosed:
            ending.end(Outcome.DISCONNECTED)
            return None
        received_at = trio.current_time()
    if timeout.cancelled_caught:
        raise StartFailure(ErrorCode.START_TIMEOUT, "Timeout waiting for session.start")
    try:
        start = protocol.parse_start(
            raw,
            limits=config.limits,
            served_model=config.served_model,
            defaults=resources.engine.video_defaults,
        )
    except protocol.ProtocolError as exc:
        ending.end(Outcome.REJECTED, (exc.code, exc.message))
        return None
    return start, received_at


def session_sound(start: protocol.SessionStart, engine: Engine) -> AudioFormat | None:
    """The audio track of the session's video, or None for a video without one, as
    ``generate_sound`` asks (vllm-omni's meaning): left out, the engine's own way (its
    sound, if it makes any); true, its sound, refused where it makes none; false, no audio
    track, whatever the engine makes (its chunks' sound is dropped: LTX-2 makes it with
    the video, so it cannot be left out without changing the frames).

    Raises `StartFailure` (``invalid_request``) for sound the engine cannot make.
    """
    made = audio_format(engine)  # checked at the server's start already
    if made is None:
        if start.sound:
            raise invalid_start(
                f"generate_sound is not supported by {engine.name}: it makes no sound"
            )
        if start.request.sound_duration is not None:
            raise invalid_start(
                f"sound_duration is not supported by {engine.name}: it makes no sound"
            )
        return None
    return None if start.sound is False else made


async def prepare(
    start: protocol.SessionStart,
    request_id: str,
    resources: ServerResources,
    calls: SessionCalls,
    ending: Ending,
    keep_encoder: Callable[[FragmentedMP4Encoder], None],
) -> Prepared:
    """Decode inputs, open the encoder and the engine stream: every check before video.start.

    The stream opened is ``calls.stream``; an engine too slow to open it ends the session
    as stalled (on ``ending``) before the `StartFailure` that says so.
    """
    video = start.video
    sound = session_sound(start, resources.engine)
    if start.input_video is not None and not supports_video_input(resources.engine):
        raise invalid_start(
            f"input_video is not supported by {resources.engine.name}: it takes no video input"
        )
    pacer = Pacer(start.pacing) if start.pacing is not None else None
    buffer = start.request.streaming_buffer_seconds
    gate = PlaybackGate(buffer, video.fps, video.num_frames) if buffer is not None else None
    # A paced camera session: its interactions wait for their chunk's action window.
    queue = InteractionQueue(
        windows=gate is not None and "camera" in interaction_kinds(resources.engine)
    )
    try:
        scripts = Scripts.from_start(start, interaction_kinds(resources.engine))
    except ScriptRefused as exc:
        raise invalid_start(exc) from exc
    image: np.ndarray | None = None
    if start.image is not None:
        source = start.image
        if isinstance(source, protocol.ImageURL):  # cancelled with the session
            try:
                source = await fetch_image(source, resources.config.image_urls)
            except ImageFetchError as exc:
                raise invalid_start(exc) from exc
        try:
            async with resources.image_limiter:
                image = await calls.in_thread(decode_image, source.data)
        except EncodingError as exc:
            raise invalid_start(f"image_reference: {exc}") from exc
    options = start.codec_options
    try:
        encoder = await calls.in_thread(
            lambda: FragmentedMP4Encoder(
                width=video.width,
                height=video.height,
                fps=video.fps,
                codec_options=options,
                audio_sample_rate=sound.sample_rate if sound is not None else None,
                audio_channels=sound.channels if sound is not None else 1,
            )
        )
    except EncodingError as exc:
        raise invalid_start(f"extra_params.video_codec_options: {exc}") from exc
    keep_encoder(encoder)
    request = generation_request(start, request_id, image)
    stall_timeout = resources.config.stall_timeout
    # The stall guard starts with the video; until then, this is the engine's deadline.
    with trio.move_on_after(stall_timeout) as too_slow:
        try:
            await calls.open_stream(resources.engine, request)
        except InvalidRequestError as exc:
            raise invalid_start(exc) from exc
        except Exception as exc:
            logger.exception("session %s: engine could not open a stream", request_id)
            raise StartFailure(*engine_failure(exc, "opening the stream", request_id)) from exc
    if too_slow.cancelled_caught:
        logger.warning(
            "session %s: the engine did not open a stream within %.1f s, aborting",
            request_id,
            stall_timeout,
        )
        ending.end(Outcome.STALLED, STALLED_OPENING)
        raise StartFailure(*STALLED_OPENING)
    if request.input_video is not None and not isinstance(calls.stream, FollowsInput):
        missing = ", ".join(missing_members(calls.stream, FollowsInput))
        logger.error(
            "session %s: the engine's stream does not follow input (%s)", request_id, missing
        )
        raise StartFailure(
            ErrorCode.GENERATION_FAILED,
            f"{resources.engine.name} declares video input, but its stream lacks {missing}",
        )
    return Prepared(request, scripts, pacer, gate, queue)

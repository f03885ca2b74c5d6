"""``session.start``'s ``input_video``: a session that follows a live input video.

This project's extension (vllm-omni has it only in an open pull request, #3157, on an
endpoint of its own). The request says what the client will send, so that every frame
can be vetted against it before anything decodes: the format, the size, the frame rate.
The frames themselves are binary WebSocket messages after ``video.start``, one frame
each, numbered in the order they arrive; frame ``n`` belongs at media time ``n / fps``.
What the server does with them (the window of each chunk, late and early frames, the
end of the input) is the session's (``trio_vstream.session.input_video``); here are
only the request's fields, their aliases and their bounds.
"""

from typing import Any, Final, Literal

import attrs

from trio_vstream.protocol._limits import Limits
from trio_vstream.protocol._wire import field_with_checks, show

__all__ = [
    "INPUT_FRAME_FORMATS",
    "INPUT_VIDEO_ALIASES",
    "MAX_INPUT_FPS",
    "MAX_INPUT_WAIT_MS",
    "InputVideoRequest",
    "InputVideoSettings",
    "lift_input_video_aliases",
    "resolve_input_video",
]

INPUT_FRAME_FORMATS: Final = ("jpeg", "png", "webp")
"""What an input frame may be: the still-image formats whose headers the server vets
before decoding (``trio_vstream.media.image_header``). JPEG is what a page makes from a
canvas (``canvas.toBlob(..., "image/jpeg")``) at a tenth of PNG's size."""

MAX_INPUT_FPS: Final = 60
"""A camera's rate at most; every frame is a decode, capped at this rate per session."""

MAX_INPUT_WAIT_MS: Final = 5000
"""The longest a chunk may be told to wait for late input before it reuses a frame."""

INPUT_VIDEO_ALIASES: Final = {"v2v_strength": "strength"}
"""vllm-omni #3157's names for the same fields (its ``frame_format`` is ours already)."""


@attrs.frozen(kw_only=True)
class InputVideoRequest:
    """``input_video`` as sent; ``None`` fields take the output video's values."""

    frame_format: Literal["jpeg", "png", "webp"] = "jpeg"
    fps: int | None = field_with_checks(ge=1, le=MAX_INPUT_FPS)
    width: int | None = field_with_checks(ge=1)
    height: int | None = field_with_checks(ge=1)
    strength: float = field_with_checks(default=0.6, ge=0, le=1)
    """How far the output may depart from the input: 0 keeps it, 1 ignores it (as a
    video-to-video pipeline's ``strength``). vllm-omni #3157 calls it ``v2v_strength``."""
    on_end: Literal["hold", "end"] = "hold"
    """After ``input_video.end``: ``hold`` goes on from the last frame until the video's
    ``num_frames``; ``end`` completes the video once its output reaches the input's end."""
    max_wait_ms: int = field_with_checks(default=250, ge=0, le=MAX_INPUT_WAIT_MS)
    """How long past its due time a chunk waits for its input before it reuses the last
    frame it had (counted in the chunk's metadata as ``reused``)."""
    strict: bool = False
    """A malformed frame ends the session (``invalid_input_frame``), instead of being
    refused with that error while the session goes on."""


@attrs.frozen(kw_only=True)
class InputVideoSettings:
    """``input_video`` resolved: every field set, the size checked against `Limits`."""

    frame_format: str
    fps: int
    width: int
    height: int
    strength: float
    on_end: str
    max_wait_seconds: float
    strict: bool
    max_frame_bytes: int
    """The most one frame message may hold (``Limits.max_input_frame_bytes``)."""


def lift_input_video_aliases(request_data: dict[str, Any], problems: list[str]) -> None:
    """Rename vllm-omni's field names inside ``input_video`` to ours (in place); both
    names at once is a problem, since they could disagree."""
    block = request_data.get("input_video")
    if not isinstance(block, dict):
        return  # absent, or wrong and structuring says so
    renamed = dict(block)
    for alias, name in INPUT_VIDEO_ALIASES.items():
        if alias not in renamed:
            continue
        if name in renamed:
            problems.append(f"input_video: give {name} or {alias} (its alias), not both")
            renamed.pop(alias)
            continue
        renamed[name] = renamed.pop(alias)
    request_data["input_video"] = renamed


def resolve_input_video(
    request: InputVideoRequest,
    *,
    width: int,
    height: int,
    fps: int,
    limits: Limits,
    problems: list[str],
) -> InputVideoSettings | None:
    """The input's settings, its size and rate defaulting to the output's."""
    in_width = request.width if request.width is not None else width
    in_height = request.height if request.height is not None else height
    in_fps = request.fps if request.fps is not None else min(fps, MAX_INPUT_FPS)
    before = len(problems)
    if in_width * in_height > limits.max_input_pixels:
        problems.append(
            f"input_video: width * height must be at most {limits.max_input_pixels}, "
            f"got {show(in_width)} * {show(in_height)}"
        )
    for name, value, bound in (
        ("width", in_width, limits.max_width),
        ("height", in_height, limits.max_height),
    ):
        if value > bound:
            problems.append(f"input_video.{name} must be at most {bound}, got {value}")
    if len(problems) > before:
        return None
    return InputVideoSettings(
        frame_format=request.frame_format,
        fps=in_fps,
        width=in_width,
        height=in_height,
        strength=request.strength,
        on_end=request.on_end,
        max_wait_seconds=request.max_wait_ms / 1000,
        strict=request.strict,
        max_frame_bytes=limits.max_input_frame_bytes,
    )

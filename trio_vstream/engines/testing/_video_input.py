"""The video_input rule: an engine that takes input video makes, for a request that has
one, a stream the server can feed, and each chunk it returns has as many frames as it
was fed.

The server trusts ``next_chunk_frames`` to say how many input frames to gather, and maps
output frame ``j`` to input frame ``j``: a chunk of any other length would put the
input's frames out of step with the output's from then on. So the rule plays the server's
part for a few chunks, as `interfaces.FollowsInput` describes it.
"""

from __future__ import annotations

from typing import Protocol

import attrs
import numpy as np

from trio_vstream.engines.contract import Chunk, EngineStream, GenerationRequest, VideoInput
from trio_vstream.engines.interfaces import FollowsInput, missing_members, supports_video_input
from trio_vstream.engines.testing._kit import Hung, Kit, Skip, in_thread
from trio_vstream.engines.testing._probe import Probe

CHUNKS = 2
"""Chunks fed and checked (fewer when the request's video is shorter)."""

STRENGTH = 0.6
"""The strength the protocol sends when a client gives none."""


class _FollowingStream(EngineStream, FollowsInput, Protocol):
    """What the server drives for a session with an input video."""


def check_video_input(kit: Kit) -> None:
    """For an engine that declares ``video_input``: a stream opened with ``input_video``
    is `FollowsInput`, and `CHUNKS` chunks, each fed ``next_chunk_frames`` input frames,
    have exactly that many frames."""
    if not supports_video_input(kit.engine):
        return
    request = attrs.evolve(
        kit.request, input_video=VideoInput(fps=kit.request.fps, strength=STRENGTH)
    )
    try:
        stream = in_thread("open_stream", kit.timeout, kit.engine.open_stream, request)
    except Hung as exc:
        kit.fail("video_input", f"{exc} (a request with input_video)")
        raise Skip from exc
    except Exception as exc:
        kit.fail("video_input", f"open_stream raised {exc!r} for a request with input_video")
        return
    if not isinstance(stream, EngineStream):
        missing = ", ".join(missing_members(stream, EngineStream))
        kit.fail("video_input", f"open_stream returned {stream!r}, which lacks {missing}")
        return
    if isinstance(stream, FollowsInput):
        _feed_chunks(kit, stream, request)
    else:
        missing = ", ".join(missing_members(stream, FollowsInput))
        kit.fail(
            "video_input",
            f"the engine declares video_input, but its stream for a request with input_video "
            f"lacks {missing} (interfaces.FollowsInput)",
        )
    kit.close(stream, "after a stream that followed an input video")


def _feed_chunks(kit: Kit, stream: _FollowingStream, request: GenerationRequest) -> None:
    """Feed and take `CHUNKS` chunks as the server does; report the first thing wrong."""
    probe = Probe()
    done = 0
    for index in range(CHUNKS):
        if done >= request.num_frames:
            return
        count = stream.next_chunk_frames
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            kit.fail(
                "video_input",
                f"before chunk {index}, next_chunk_frames is {count!r}, not a positive int",
            )
            return
        frames = input_frames(count, request.width, request.height, done)
        try:
            in_thread("feed_input", kit.timeout, stream.feed_input, frames)
            chunk = in_thread("next_chunk", kit.timeout, stream.next_chunk, probe)
        except Hung as exc:
            kit.fail("video_input", f"{exc} (chunk {index} of a stream fed input)")
            raise Skip from exc
        except BaseException as exc:  # the engine's error, or a stop it made up
            kit.fail(
                "video_input",
                f"chunk {index}: feed_input({count} frames) then next_chunk raised {exc!r}",
            )
            return
        if chunk is None:
            kit.fail(
                "video_input",
                f"chunk {index}: next_chunk returned None after next_chunk_frames said {count}",
            )
            return
        made = kit.check_chunk(chunk, index, request)
        if isinstance(chunk, Chunk) and len(made) != count:
            kit.fail(
                "video_input",
                f"chunk {index} has {len(made)} frames, fed {count} (next_chunk_frames): "
                "output frame j is made from input frame j",
            )
            return
        done += count


def input_frames(count: int, width: int, height: int, first: int) -> np.ndarray:
    """``count`` input frames, (count, height, width, 3) uint8: a saturated green square
    moving across a mid grey, one step a frame from frame ``first`` on, so that an engine
    that follows its input has something to follow."""
    frames = np.full((count, height, width, 3), 128, np.uint8)
    side = max(1, min(width, height) // 4)
    for j in range(count):
        x = (first + j) * max(1, width // 16) % max(1, width - side)
        y = (first + j) * max(1, height // 16) % max(1, height - side)
        frames[j, y : y + side, x : x + side] = (40, 200, 60)
    return frames

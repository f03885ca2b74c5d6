"""The fuzz's fixed choices: the server it starts, and how long it waits for what.

The timeouts are far above what a healthy server needs on a loaded 2-core machine, so
that only a server that really does not answer is a violation; they live apart from the
code that waits, because the oracle names them in its problem texts too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from bench import _harness, _output
from trio_vstream import protocol

FAULT_KEYS: Final = ("fail_at_chunk", "hang_at_chunk")
"""``extra_params`` the synthetic engine takes as fault injections: with these, a failed
or stuck generation is what was asked for."""

ENGINE_ARGS: Final = (("steps", "2"), ("step_delay", "0.01"), ("chunk_frames", "4"))
"""A chunk every ~20 ms: the control session streams for seconds (2400 frames), and an
accepted start shows its first chunk soon enough to be checked."""
CONTROL_SIZE: Final = 64
"""The control sessions' width and height: their input frames' too."""
CONTROL_INPUT_FORMATS: Final = ("jpeg", None, "png", "webp")
"""The input video each control session follows, in turn (None: none). Every binary
control input is an input frame then: it meets sessions that take its format, sessions
that take another, and one that takes no frames at all (``invalid_message``)."""
CONTROL_SESSION_INPUTS: Final = 250
"""Control inputs per session at most: then the next session, so that a run of 1000
has a session of each input video (and none) whatever the inputs drawn."""
CONTROL_INPUT_VIDEO: Final = {"fps": 24, "strength": 0.5, "max_wait_ms": 0}
"""At the output's rate, blended half and half; a chunk waits only for its frames' due
time (``max_wait_ms`` 0), so a session whose frames come seldom still streams: a chunk
every 4/24 s until ``input_video.end``, then every ~20 ms."""


def control_start(input_format: str | None) -> str:
    """The control session's ``session.start``: with an input video of ``input_format``
    (jpeg, png or webp) of the session's size, or (None) without."""
    fields: dict[str, object] = {"size": f"{CONTROL_SIZE}x{CONTROL_SIZE}", "fps": 24}
    fields["num_frames"] = 2400
    if input_format is not None:
        fields["input_video"] = {"frame_format": input_format, **CONTROL_INPUT_VIDEO}
    return protocol.start_message("fuzz: control session", **fields)


SERVED_MODEL: Final = "synthetic"
CLIENT_MAX_MESSAGE: Final = 64 * 1024 * 1024
HEALTH_EVERY: Final = 250
"""Inputs between two ``GET /health`` checks (each phase counts its own)."""
START_TIMEOUT: Final = 30.0
"""Seconds one ``session.start`` input may take, up to its close; beyond, a violation."""
FIRST_CHUNK_WAIT: Final = 5.0
"""How long an accepted session may take to show its first chunk before it is stopped
anyway (slowness is not a violation; a missing terminal message is)."""
REPLY_TIMEOUT: Final = 10.0
"""Seconds a control message and its ping have to be answered."""
STUCK_AFTER: Final = 10.0
"""Seconds without a chunk after which a control session counts as stuck. Pings keep
the server's stall guard from noticing an engine that hangs, so the fuzz has to."""
SETTLE_CHUNKS: Final = 2
"""Chunks to wait for after a replayed control message: an interaction takes effect at
the next chunk boundary, so a failure it causes shows by then."""


def progress(message: str) -> None:
    """The bench's progress line on stderr, marked as the fuzz's."""
    _output.progress(f"fuzz: {message}")


def server_command(limits: protocol.Limits, extra: Sequence[str]) -> list[str]:
    """The server under test: room for every start worker and the control session at
    once (32), and the byte limits the inputs are sized against."""
    return _harness.synthetic_server_command(
        ENGINE_ARGS,
        max_sessions=32,
        max_start_bytes=limits.max_start_bytes,
        max_control_bytes=limits.max_control_bytes,
        extra=extra,
    )

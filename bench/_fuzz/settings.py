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
CONTROL_START: Final = protocol.start_message(
    "fuzz: control session", size="64x64", fps=24, num_frames=2400
)
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

"""The JSON documents a server answers with: ``GET /stats`` and ``GET /v1/models``.

Each is built from what it reports, handed in, so that its shape is read in one place,
apart from the listener's state: ``/stats`` what the server has done (for dashboards and
benchmarks), ``/v1/models`` what it serves and what a client may ask of it.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from typing import Any

import attrs

from trio_vstream.engines.contract import Engine
from trio_vstream.engines.interfaces import interaction_kinds, supports_video_input
from trio_vstream.protocol import Limits
from trio_vstream.scheduling.batcher import StepBatcher
from trio_vstream.server.config import VIDEO_PATH
from trio_vstream.server.running import RunningSessions
from trio_vstream.session.session import ServerCounters

__all__ = ["models_document", "stats_document"]


def stats_document(
    engine_name: str,
    stats: ServerCounters,
    sessions: RunningSessions,
    claimed: int,
    batcher: StepBatcher | None,
    node: str | None = None,
) -> dict[str, Any]:
    """``GET /stats``: counters for dashboards and benchmarks, as JSON (``claimed``: the
    upgrades holding a claim on a session slot, `trio_vstream.server.slots`). Times are
    ``time.monotonic()`` seconds, which other processes on the same host can compare
    with their own."""
    return {
        "engine": engine_name,
        "node": node,
        "monotonic": time.monotonic(),
        "sessions_active": stats.sessions_active,
        "sessions_running": sessions.running,
        "sessions_waiting": sessions.waiting,
        "sessions_claimed": claimed,
        "sessions_total": stats.sessions_total,
        "streams_open": stats.streams_open,
        "worker_threads": stats.worker_threads,
        "chunks_sent": stats.chunks_sent,
        "engine_cpu_seconds": stats.engine_cpu_seconds,
        "batches": batcher.batches if batcher else 0,
        "batch_rows": batcher.rows if batcher else 0,
        "threads_alive": threading.active_count(),
        "rss_bytes": _rss_bytes(),
        "recent_sessions": [attrs.asdict(s, value_serializer=_jsonable) for s in sessions.recent],
    }


def models_document(
    engine: Engine,
    *,
    served_model: str,
    created: int,
    limits: Limits,
    live_defaults: dict[str, int | float],
    max_batch: int,
    live_input_chunk_frames: int | None,
) -> dict[str, Any]:
    """``GET /v1/models``: OpenAI's list shape, so existing tooling finds the model.

    The ``trio_vstream`` key is this server's extension: what a page or a client
    may ask for (the engine's defaults, the server's limits, what an interaction may
    carry) without trial and error.
    """
    return {
        "object": "list",
        "data": [
            {
                "id": served_model,
                "object": "model",
                "created": created,
                "owned_by": "trio_vstream",
                "trio_vstream": {
                    "engine": engine.name,
                    "endpoint": VIDEO_PATH,
                    "video_defaults": attrs.asdict(engine.video_defaults),
                    "limits": attrs.asdict(limits),
                    "interaction_kinds": sorted(interaction_kinds(engine)),
                    "live_defaults": live_defaults,
                    "live_input_chunk_frames": live_input_chunk_frames,
                    "max_batch": max_batch,
                    "video_input": supports_video_input(engine),
                },
            }
        ],
    }


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _jsonable(_inst: Any, _field: Any, value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value

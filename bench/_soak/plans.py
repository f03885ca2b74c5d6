"""What each soak session does, decided up front from the seed.

Every random choice (the kind, the request, delays, garbage, disconnect points) is made
here, before anything runs, so that a seed names one mix of sessions exactly and a
failing session can be run again from its plan; only the interleavings are left to the
machine.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any, Final

import attrs

from bench._soak.settings import (
    DISCONNECT_PHASES,
    KINDS,
    MAX_CONTROL_BYTES,
    MAX_START_BYTES,
    OVERSIZED_FRAME_FACTOR,
    PROMPTS,
)


@attrs.frozen(kw_only=True)
class Plan:
    """One session, decided up front: the kind, its request, and its random choices."""

    index: int
    kind: str
    warmup: bool
    start: dict[str, Any] | None
    """The ``session.start`` fields sent (None: the kind sends none, or something else)."""
    params: dict[str, Any]
    """Kind-specific choices (delays, garbage, phases), JSON-able for the report."""

    @property
    def num_frames(self) -> int:
        return int(self.start["num_frames"]) if self.start else 0

    @property
    def label(self) -> str:
        variant = self.params.get("phase") or self.params.get("where")
        return f"{self.kind}({variant})" if variant else self.kind

    def start_text(self) -> str:
        assert self.start is not None
        return json.dumps({"type": "session.start", **self.start})


GARBAGE: Final[dict[str, tuple[str, str, str]]] = {
    # name: (payload, expected code instead of session.start, expected code mid-session)
    "non_json": ("this is not JSON {", "invalid_json", "invalid_json"),
    "binary_junk": ("<binary>", "invalid_json", "invalid_json"),
    "json_array": ("[1, 2, 3]", "invalid_message", "invalid_message"),
    "json_string": ('"session.start"', "invalid_message", "invalid_message"),
    "json_number": ("42", "invalid_message", "invalid_message"),
    "json_null": ("null", "invalid_message", "invalid_message"),
    "unknown_type": ('{"type": "session.dance"}', "invalid_message", "unknown_type"),
    "missing_type": ('{"prompt": "a cat"}', "invalid_message", "unknown_type"),
    "bad_interaction": (
        '{"type": "session.interaction", "interaction": {"event": {}}}',
        "invalid_message",
        "invalid_message",
    ),
}
BAD_START: Final = ('{"type": "session.start", "promt": "a cat"}', "invalid_request")
"""A misspelt field: only meaningful in place of session.start."""


def _garbage(rng: random.Random, where: str) -> dict[str, Any]:
    """One bad message: its payload (text or hex of binary) and the expected error code."""
    names = list(GARBAGE) + (["bad_start"] if where == "start" else [])
    name = rng.choice(names)
    if name == "bad_start":
        return {"label": name, "text": BAD_START[0], "expect": f"error:{BAD_START[1]}"}
    payload, at_start, mid = GARBAGE[name]
    code = at_start if where == "start" else mid
    step: dict[str, Any] = {"label": f"garbage:{name}", "expect": f"error:{code}"}
    if name == "binary_junk":
        # 0xff never occurs in UTF-8, so this can never be read as JSON by chance.
        junk = bytes([0xFF, 0xFE]) + rng.randbytes(rng.randint(1, 200))
        step["hex"] = junk.hex()
    else:
        step["text"] = payload
    return step


def padded_start(base: dict[str, Any], size: int) -> str:
    """A session.start of exactly ``size`` bytes (UTF-8), padded in the prompt."""
    text = json.dumps({"type": "session.start", **base, "prompt": ""})
    return json.dumps({"type": "session.start", **base, "prompt": "x" * (size - len(text))})


def padded_interaction(size: int, event_id: str) -> str:
    stub = {"type": "session.interaction", "interaction": {"event_id": event_id}}
    empty = json.dumps({**stub, "interaction": {"event_id": event_id, "event": {"prompt": ""}}})
    prompt = "y" * (size - len(empty))
    return json.dumps({**stub, "interaction": {"event_id": event_id, "event": {"prompt": prompt}}})


def make_plan(rng: random.Random, index: int, kind: str, *, warmup: bool = False) -> Plan:
    """Draw one session's request and random choices for ``kind``."""
    size = rng.choice((64, 64, 64, 128))
    start: dict[str, Any] | None = {
        "prompt": rng.choice(PROMPTS),
        "width": size,
        "height": size,
        "fps": 24,
        "num_frames": rng.randint(8, 64),
        "seed": rng.randint(0, 2**31),
    }
    params: dict[str, Any] = {}
    assert start is not None
    if kind == "stop":
        start["num_frames"] = rng.randint(32, 96)
        params["stop_after_s"] = round(rng.uniform(0.0, 0.4), 4)
    elif kind == "chatty":
        start["num_frames"] = rng.randint(96, 160)
        controls: list[dict[str, Any]] = []
        ids: list[str] = []
        for i in range(rng.randint(1, 5)):
            choice = rng.random()
            if choice < 0.45:
                controls.append({"label": "ping", "text": '{"type": "session.ping"}'})
                controls[-1]["expect"] = "pong"
            elif choice < 0.85 or not ids:
                event_id = f"ev-{i}"
                ids.append(event_id)
                text = json.dumps(
                    {
                        "type": "session.interaction",
                        "interaction": {
                            "event_id": event_id,
                            "event": {"prompt": rng.choice(PROMPTS)},
                            "transition_chunks": rng.randint(0, 3),
                        },
                    }
                )
                controls.append(
                    {
                        "label": f"interaction:{event_id}",
                        "text": text,
                        "expect": f"queued:{event_id}",
                    }
                )
            else:  # an event id already used: a bad control message, the session goes on
                event_id = rng.choice(ids)
                text = json.dumps(
                    {
                        "type": "session.interaction",
                        "interaction": {"event_id": event_id, "event": {"prompt": "again"}},
                    }
                )
                controls.append(
                    {
                        "label": f"interaction:{event_id}(reused)",
                        "text": text,
                        "expect": "error:event_id_conflict",
                    }
                )
            controls[-1]["delay"] = round(rng.uniform(0.0, 0.03), 4)
        params["controls"] = controls
    elif kind == "pings_to_close":
        start["num_frames"] = rng.randint(16, 64)
        params["ping_every_s"] = round(rng.uniform(0.003, 0.015), 4)
    elif kind == "slow_reader":
        start["num_frames"] = rng.randint(16, 64)
        count = 2 * math.ceil(start["num_frames"] / 4) + 4
        params["read_delays"] = [round(rng.uniform(0.0, 0.05), 4) for _ in range(count)]
    elif kind == "stopped_reader":
        start["width"] = start["height"] = 64
        start["num_frames"] = 480  # 120 chunks: far more than the socket buffers hold
        params["read_messages"] = rng.randint(1, 12)
    elif kind in ("fin", "rst", "close"):
        start["num_frames"] = rng.randint(64, 160)
        params["phase"] = rng.choice(DISCONNECT_PHASES)
        params["delay_s"] = round(rng.uniform(0.0, 0.3), 4)
    elif kind == "garbage_start":
        params["garbage"] = _garbage(rng, "start")
        start = None
    elif kind == "garbage_mid":
        start["num_frames"] = rng.randint(96, 160)
        steps = [_garbage(rng, "mid") for _ in range(rng.randint(1, 4))]
        steps.append({"label": "ping", "text": '{"type": "session.ping"}', "expect": "pong"})
        for step in steps:
            step["delay"] = round(rng.uniform(0.0, 0.02), 4)
        params["controls"] = steps
    elif kind == "oversized_start":
        params["bytes"] = MAX_START_BYTES + rng.randint(1, 2048)
        params["text"] = padded_start(start, params["bytes"])
        start = None
    elif kind == "oversized_control":
        start["num_frames"] = rng.randint(96, 160)
        oversized = MAX_CONTROL_BYTES + rng.randint(1, 2048)
        params["controls"] = [
            {
                "label": f"oversized:{oversized}",
                "text": padded_interaction(oversized, "big"),
                "expect": "error:message_too_large",
                "delay": 0.0,
            },
            {"label": "ping", "text": '{"type": "session.ping"}', "expect": "pong", "delay": 0.0},
        ]
    elif kind == "oversized_frame":
        params["where"] = rng.choice(("start", "mid"))
        start["num_frames"] = rng.randint(96, 160)
        params["bytes"] = OVERSIZED_FRAME_FACTOR * max(MAX_START_BYTES, MAX_CONTROL_BYTES) + (
            rng.randint(1, 4096)
        )
    elif kind == "no_start":
        start = None
    elif kind == "engine_fail":
        start["num_frames"] = rng.randint(16, 64)
        params["at_chunk"] = rng.randint(0, start["num_frames"] // 4 - 1)
        start["extra_params"] = {"fail_at_chunk": params["at_chunk"]}
    elif kind == "engine_hang":
        start["num_frames"] = rng.randint(16, 64)
        params["at_chunk"] = rng.randint(0, start["num_frames"] // 4 - 1)
        start["extra_params"] = {"hang_at_chunk": params["at_chunk"]}
    elif kind != "normal":
        raise ValueError(f"unknown session kind {kind!r}")
    return Plan(index=index, kind=kind, warmup=warmup, start=start, params=params)


def make_plans(seed: int, sessions: int, warmup: int) -> list[Plan]:
    """The warm-up sessions, then the measured ones: the same seed gives the same plans.

    Each kind comes at least once among the measured sessions when there are enough of
    them, so a short run still covers every kind; the rest are drawn by weight.
    """
    rng = random.Random(seed)
    names = list(KINDS)
    weights = [KINDS[name] for name in names]
    warm = [rng.choices(names, weights)[0] for _ in range(warmup)]
    kinds = list(names) if sessions >= len(names) else []
    kinds += rng.choices(names, weights, k=sessions - len(kinds))
    rng.shuffle(kinds)
    plans = [make_plan(rng, i, kind, warmup=True) for i, kind in enumerate(warm)]
    plans += [make_plan(rng, warmup + i, kind) for i, kind in enumerate(kinds)]
    return plans

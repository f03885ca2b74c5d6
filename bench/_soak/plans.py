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
    BACK_TO_BACK_SHARE,
    DISCONNECT_PHASES,
    FIRST_SIGNAL_AFTER_S,
    HELD_NUM_FRAMES,
    HOLD_PARAM,
    INPUT_FPS,
    INPUT_FRAME_FORMAT,
    INPUT_PICTURES,
    KINDS,
    MAX_CONTROL_BYTES,
    MAX_START_BYTES,
    OVERSIZED_FRAME_FACTOR,
    PROMPTS,
    ROUND_BLOCK_S,
    ROUND_ENGINES,
    ROUND_FRAME_SIZE,
    ROUND_KINDS,
    ROUND_NUM_FRAMES,
    ROUND_SESSIONS,
    SIGNALS,
    STUCK_AT_CHUNK,
    STUCK_DRAIN_SHARE,
    STUCK_ENGINE,
    STUCK_EXTRA_S,
    STUCK_SESSIONS,
    STUCK_VARIANTS,
    ZERO_DELAY_SHARE,
    Timing,
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
        variant = self.params.get("phase") or self.params.get("where") or self.params.get("variant")
        return f"{self.kind}({variant})" if variant else self.kind

    @property
    def on_end(self) -> str | None:
        """An ``input_video`` session's ``on_end`` (None for the other kinds)."""
        block = self.start.get("input_video") if self.start else None
        return block.get("on_end") if isinstance(block, dict) else None

    def start_text(self) -> str:
        assert self.start is not None
        return json.dumps({"type": "session.start", **self.start})


DEFAULT_TIMING: Final = Timing()
"""The soak's default timeouts (a frozen value: safe as a default argument)."""

GARBAGE: Final[dict[str, tuple[str, str, str]]] = {
    # name: (payload, expected code instead of session.start, expected code mid-session)
    "non_json": ("this is not JSON {", "invalid_json", "invalid_json"),
    # Mid-session a binary message is an input video frame, which a session without
    # input_video refuses as such.
    "binary_junk": ("<binary>", "invalid_json", "invalid_message"),
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


def make_plan(
    rng: random.Random,
    index: int,
    kind: str,
    *,
    warmup: bool = False,
    timing: Timing = DEFAULT_TIMING,
) -> Plan:
    """Draw one session's request and random choices for ``kind`` (``timing``: the
    server's timeouts, which an ``engine_stuck`` block outlasts)."""
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
    elif kind == "engine_stuck":
        # Blocks outside any checkpoint at that chunk, for longer than the stall timeout:
        # the client must hear of the stall while the engine is still blocked.
        start["num_frames"] = rng.randint(16, 64)
        params["at_chunk"] = rng.randint(0, start["num_frames"] // 4 - 1)
        params["variant"] = rng.choice(STUCK_VARIANTS)
        params["block_s"] = timing.stuck_block_s(params["variant"], rng.uniform(*STUCK_EXTRA_S))
        start["extra_params"] = {
            "block_at_chunk": params["at_chunk"],
            "block_seconds": params["block_s"],
        }
    elif kind == "input_video":
        # JPEG frames sent at the input's rate while the video streams, then
        # input_video.end: sometimes fewer than the video needs (held, or the video
        # ends with them), sometimes more (the video ends first).
        in_fps = rng.choice(INPUT_FPS)
        needed = math.ceil(start["num_frames"] * in_fps / start["fps"])
        params["frames"] = rng.randint(max(1, needed // 2), needed + 8)
        params["fps"] = in_fps
        params["first_picture"] = rng.randrange(INPUT_PICTURES)
        start["input_video"] = {
            "frame_format": INPUT_FRAME_FORMAT,
            "fps": in_fps,
            "strength": round(rng.uniform(0.0, 1.0), 2),
            "on_end": rng.choice(("hold", "end")),
            "max_wait_ms": rng.choice((0, 100, 250)),
        }
    elif kind != "normal":
        raise ValueError(f"unknown session kind {kind!r}")
    return Plan(index=index, kind=kind, warmup=warmup, start=start, params=params)


def make_held_plan(rng: random.Random, index: int, token: str) -> Plan:
    """A wedge round's session (the batched part): a long video whose steps share the
    round's hold token (``extra_params.hold``) with the round's other held session, so
    that their rows meet in a batch that the held engine holds until the soak creates
    the token's file. The session must end with ``stall_timeout`` (``checks``)."""
    start: dict[str, Any] = {
        "prompt": rng.choice(PROMPTS),
        "width": ROUND_FRAME_SIZE,
        "height": ROUND_FRAME_SIZE,
        "fps": 24,
        "num_frames": HELD_NUM_FRAMES,
        "seed": rng.randint(0, 2**31),
        "extra_params": {HOLD_PARAM: token},
    }
    return Plan(index=index, kind="held", warmup=False, start=start, params={"token": token})


def hold_token(rng: random.Random, round_index: int) -> str:
    """A wedge round's hold token: its number and random letters, so that a file left by
    an earlier run in the hold directory can never release it."""
    return f"wedge-{round_index}-{rng.randbytes(6).hex()}"


def make_plans(
    seed: int, sessions: int, warmup: int, timing: Timing = DEFAULT_TIMING
) -> list[Plan]:
    """The warm-up sessions, then the measured ones: the same seed (and timing) gives the
    same plans.

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
    plans = [make_plan(rng, i, kind, warmup=True, timing=timing) for i, kind in enumerate(warm)]
    plans += [make_plan(rng, warmup + i, kind, timing=timing) for i, kind in enumerate(kinds)]
    return plans


# --------------------------------------------------------------------------------------
# Shutdown rounds
# --------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SignalStep:
    """One signal a round sends to its server, and when."""

    name: str
    """``SIGTERM`` or ``SIGINT``."""
    after: str
    """What the delay counts from: ``streaming`` (every session has had a media chunk; the
    first signal), ``taken`` (the server has logged the signal before this one, so this
    one cannot merge with it) or ``sent`` (the signal before was sent, maybe not read)."""
    delay_s: float

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class ShutdownPlan:
    """One shutdown round, decided up front: its engine, sessions and signals."""

    index: int
    kind: str
    engine: str
    starts: tuple[dict[str, Any], ...]
    """Each session's ``session.start`` fields."""
    signals: tuple[SignalStep, ...]

    @property
    def stuck(self) -> int:
        """Sessions whose engine blocks (``stuck_at``)."""
        return sum(1 for start in self.starts if stuck_at(start) is not None)

    @property
    def label(self) -> str:
        count = len(self.starts)
        stuck = f", {self.stuck} stuck" if self.stuck else ""
        return f"{self.kind}({self.engine}, {count} session{'' if count == 1 else 's'}{stuck})"

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "engine": self.engine,
            "sessions": len(self.starts),
            "stuck": self.stuck,
            "starts": list(self.starts),
            "signals": [step.to_json() for step in self.signals],
        }


def stuck_at(start: dict[str, Any]) -> int | None:
    """The chunk at which a round's session's engine blocks (None: it streams)."""
    extra = start.get("extra_params")
    value = extra.get("block_at_chunk") if isinstance(extra, dict) else None
    return value if isinstance(value, int) else None


def make_shutdown_plan(rng: random.Random, index: int, kind: str, engine: str) -> ShutdownPlan:
    """Draw one round of ``kind`` on ``engine``.

    ``double_signal``: 1-8 sessions stream a long video; the first signal comes
    0-0.3 s after each has had a media chunk; the second, the other signal at once
    (``sent``, 0 s) in a fifth of the rounds, otherwise either signal once the server
    has logged the first (``taken``): at once in a quarter of those, else after a delay
    drawn over two of the engine's steps, so that some land while a step (a batch, for
    shapes) is in flight.

    ``engine_stuck`` (the synthetic engine): 1-2 sessions whose engine blocks outside a
    checkpoint at chunk 0-2 for ``ROUND_BLOCK_S``, the rest (0-6) stream. The first
    signal comes 0-0.3 s after every session streams and every stuck one is blocked
    (``BLOCKED_SILENCE_S``). Half the rounds are a drain: that one signal, stuck sessions
    only (each ends by its stall timeout, then its call is left behind); the others send
    a second signal, drawn as for ``double_signal``. Either way the process must exit
    within its bound while the threads are still blocked.
    """
    if kind not in ROUND_KINDS:
        raise ValueError(f"unknown shutdown round kind {kind!r}")
    if kind == "engine_stuck" and engine != STUCK_ENGINE:
        raise ValueError(f"engine_stuck rounds run the {STUCK_ENGINE} engine, not {engine!r}")

    def start() -> dict[str, Any]:
        return {
            "prompt": rng.choice(PROMPTS),
            "width": ROUND_FRAME_SIZE,
            "height": ROUND_FRAME_SIZE,
            "fps": 24,
            "num_frames": ROUND_NUM_FRAMES,
            "seed": rng.randint(0, 2**31),
        }

    drain = False
    if kind == "double_signal":
        starts = tuple(start() for _ in range(rng.randint(*ROUND_SESSIONS)))
    else:
        drain = rng.random() < STUCK_DRAIN_SHARE
        stuck = rng.randint(*STUCK_SESSIONS)
        healthy = 0 if drain else rng.randint(0, ROUND_SESSIONS[1] - stuck)
        blocked = [
            {
                **start(),
                "extra_params": {
                    "block_at_chunk": rng.randint(*STUCK_AT_CHUNK),
                    "block_seconds": ROUND_BLOCK_S,
                },
            }
            for _ in range(stuck)
        ]
        starts = (*blocked, *(start() for _ in range(healthy)))
    first_name = rng.choice(SIGNALS)
    first = SignalStep(
        name=first_name, after="streaming", delay_s=round(rng.uniform(*FIRST_SIGNAL_AFTER_S), 4)
    )
    if drain:
        signals: tuple[SignalStep, ...] = (first,)
    elif rng.random() < BACK_TO_BACK_SHARE:
        other = next(name for name in SIGNALS if name != first_name)
        signals = (first, SignalStep(name=other, after="sent", delay_s=0.0))
    else:
        delay = 0.0
        if rng.random() >= ZERO_DELAY_SHARE:
            delay = round(rng.uniform(0.0, 2 * ROUND_ENGINES[engine].step_s), 4)
        signals = (first, SignalStep(name=rng.choice(SIGNALS), after="taken", delay_s=delay))
    return ShutdownPlan(index=index, kind=kind, engine=engine, starts=starts, signals=signals)


def make_shutdown_plans(seed: int, rounds: int) -> list[ShutdownPlan]:
    """The shutdown rounds of a seed: each kind at least once when there are as many
    rounds as kinds, the rest drawn by weight, shuffled; ``engine_stuck`` rounds run
    ``STUCK_ENGINE``, the others alternate the engines (shapes first).

    Drawn from a generator of their own, so that the number of rounds never changes the
    sessions' plans: a seed names the same session mix with or without them.
    """
    rng = random.Random(f"soak-shutdown-rounds-{seed}")
    names = list(ROUND_KINDS)
    weights = [ROUND_KINDS[name] for name in names]
    kinds = list(names) if rounds >= len(names) else []
    kinds += rng.choices(names, weights, k=rounds - len(kinds))
    rng.shuffle(kinds)
    engines = list(ROUND_ENGINES)
    plans: list[ShutdownPlan] = []
    turn = 0
    for i, kind in enumerate(kinds):
        if kind == "engine_stuck":
            engine = STUCK_ENGINE
        else:
            engine, turn = engines[turn % len(engines)], turn + 1
        plans.append(make_shutdown_plan(rng, i, kind, engine))
    return plans

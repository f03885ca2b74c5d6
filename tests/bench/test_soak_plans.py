"""The soak's plans (``bench/_soak/plans.py``): seeded, covering every kind, payloads of
the sizes they claim.
"""

from __future__ import annotations

import json
import random

import pytest

from bench._soak.plans import (
    hold_token,
    make_held_plan,
    make_plan,
    make_plans,
    padded_interaction,
    padded_start,
)
from bench._soak.settings import (
    HELD_NUM_FRAMES,
    HOLD_TOKEN,
    INPUT_FPS,
    INPUT_FRAME_FORMAT,
    KINDS,
    MAX_START_BYTES,
    STUCK_ORDER_MARGIN_S,
    Timing,
)
from trio_vstream.engines.synthetic import BLOCK_SECONDS_MAX


def test_plans_are_seeded_and_cover_every_kind() -> None:
    first = make_plans(seed=7, sessions=40, warmup=4)
    assert first == make_plans(seed=7, sessions=40, warmup=4)
    assert first != make_plans(seed=8, sessions=40, warmup=4)
    measured = [p for p in first if not p.warmup]
    assert len(measured) == 40 and len(first) == 44
    assert {p.kind for p in measured} == set(KINDS)
    for plan in first:
        json.dumps(plan.params)  # reported as they are
        if plan.kind in ("engine_fail", "engine_hang", "engine_stuck"):
            assert plan.params["at_chunk"] < plan.num_frames // 4  # the fault is reached
        if plan.kind == "oversized_start":
            assert len(plan.params["text"]) > MAX_START_BYTES


def test_oversized_payloads_have_the_sizes_they_claim() -> None:
    start = {"prompt": "x", "width": 64, "height": 64}
    assert len(padded_start(start, 40_000)) == 40_000
    assert len(padded_interaction(9_000, "big")) == 9_000
    json.loads(padded_interaction(9_000, "big"))


@pytest.mark.parametrize("timing", [Timing(), Timing(stall_timeout=3.0, slack=0.5)])
def test_stuck_engines_block_longer_than_the_stall_timeout_as_their_variant_needs(
    timing: Timing,
) -> None:
    """``returns``: the stall error (at most stall + slack after the block began) comes
    at least the order margin (and 0.5 s) before the block ends, which is before the
    session's close wait ends; ``abandoned``: the block outlasts that wait by a slack."""
    rng = random.Random(5)
    seen = set()
    for i in range(200):
        plan = make_plan(rng, i, "engine_stuck", timing=timing)
        block_s, variant = plan.params["block_s"], plan.params["variant"]
        seen.add(variant)
        assert plan.start is not None
        assert plan.start["extra_params"] == {
            "block_at_chunk": plan.params["at_chunk"],
            "block_seconds": block_s,
        }
        assert plan.params["at_chunk"] < plan.num_frames // 4
        assert 0 < block_s <= BLOCK_SECONDS_MAX
        latest_error = timing.stall_timeout + timing.slack
        close_wait_ends = timing.stall_timeout - timing.early + timing.close_timeout
        if variant == "returns":
            assert block_s - latest_error >= max(0.5, STUCK_ORDER_MARGIN_S)
            assert block_s < close_wait_ends
        else:
            assert block_s >= latest_error + timing.close_timeout + timing.slack + 0.5
        assert plan.label == f"engine_stuck({variant})"
    assert seen == {"returns", "abandoned"}
    with pytest.raises(ValueError, match="unknown engine_stuck variant"):
        timing.stuck_block_s("sometimes", 1.0)


def test_held_plans_share_their_rounds_token_and_tokens_never_repeat() -> None:
    """A wedge round's sessions (the batched part): a long video whose steps share the
    round's hold token, which the held engine accepts; each round's token is new."""
    rng = random.Random(3)
    tokens = [hold_token(rng, i) for i in range(50)]
    assert len(set(tokens)) == 50 and all(HOLD_TOKEN.fullmatch(t) for t in tokens)
    assert tokens[0].startswith("wedge-0-") and tokens[49].startswith("wedge-49-")
    plans = [make_held_plan(rng, i, tokens[0]) for i in range(2)]
    for plan in plans:
        assert plan.kind == "held" and plan.label == "held" and not plan.warmup
        assert plan.start is not None and plan.start["extra_params"] == {"hold": tokens[0]}
        assert plan.num_frames == HELD_NUM_FRAMES
        json.loads(plan.start_text())


def test_input_video_plans_ask_for_jpeg_frames_at_a_rate_and_end_them() -> None:
    rng = random.Random(3)
    plans = [make_plan(rng, i, "input_video") for i in range(40)]
    for plan in plans:
        assert plan.start is not None
        block = plan.start["input_video"]
        assert block["frame_format"] == INPUT_FRAME_FORMAT and block["fps"] in INPUT_FPS
        assert block["fps"] == plan.params["fps"] and 0 <= block["strength"] <= 1
        assert plan.on_end == block["on_end"] and plan.params["frames"] >= 1
        needed = -(-plan.num_frames * block["fps"] // 24)
        assert plan.params["frames"] <= needed + 8
    assert {plan.on_end for plan in plans} == {"hold", "end"}
    assert {plan.params["fps"] for plan in plans} == set(INPUT_FPS)
    # Some send fewer frames than their video needs, some more.
    needs = [(p.params["frames"], -(-p.num_frames * p.params["fps"] // 24)) for p in plans]
    assert any(sent < needed for sent, needed in needs)
    assert any(sent > needed for sent, needed in needs)
    assert make_plan(random.Random(3), 0, "normal").on_end is None

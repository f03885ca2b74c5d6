"""The soak's plans (``bench/_soak/plans.py``): seeded, covering every kind, payloads of
the sizes they claim.
"""

from __future__ import annotations

import json

from bench._soak.plans import make_plans, padded_interaction, padded_start
from bench._soak.settings import KINDS, MAX_START_BYTES


def test_plans_are_seeded_and_cover_every_kind() -> None:
    first = make_plans(seed=7, sessions=40, warmup=4)
    assert first == make_plans(seed=7, sessions=40, warmup=4)
    assert first != make_plans(seed=8, sessions=40, warmup=4)
    measured = [p for p in first if not p.warmup]
    assert len(measured) == 40 and len(first) == 44
    assert {p.kind for p in measured} == set(KINDS)
    for plan in first:
        json.dumps(plan.params)  # reported as they are
        if plan.kind in ("engine_fail", "engine_hang"):
            assert plan.params["at_chunk"] < plan.num_frames // 4  # the fault is reached
        if plan.kind == "oversized_start":
            assert len(plan.params["text"]) > MAX_START_BYTES


def test_oversized_payloads_have_the_sizes_they_claim() -> None:
    start = {"prompt": "x", "width": 64, "height": 64}
    assert len(padded_start(start, 40_000)) == 40_000
    assert len(padded_interaction(9_000, "big")) == 9_000
    json.loads(padded_interaction(9_000, "big"))

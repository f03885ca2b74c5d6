"""The fuzz's inputs (``bench/_fuzz/strategies.py`` and the ``values.py`` and ``objects.py``
they are made of, ``bench/_fuzz/wire.py``): sendable, varied, reproducible from the seed,
reaching the engine often enough; input frames what their kind says they are.
"""

from __future__ import annotations

import json

import pytest

from bench._fuzz.settings import CONTROL_SIZE
from bench._fuzz.strategies import control_inputs, draw_inputs, start_inputs
from bench._fuzz.wire import Raw, to_json, wire_size
from trio_vstream import protocol
from trio_vstream.media.errors import EncodingError
from trio_vstream.media.image_decode import vet_frame

SMALL_LIMITS = protocol.Limits(max_start_bytes=4096, max_control_bytes=1024)


def test_inputs_are_sendable_varied_and_reproducible() -> None:
    inputs = draw_inputs(start_inputs(SMALL_LIMITS), 300, seed=3)
    assert len(inputs) == 300 and len({item.wire for item in inputs}) == 300
    assert inputs == draw_inputs(start_inputs(SMALL_LIMITS), 300, seed=3)
    assert inputs != draw_inputs(start_inputs(SMALL_LIMITS), 300, seed=4)
    # Which kinds one seed draws depends on Hypothesis's pool of constants, which grows
    # with the modules a test run has imported: ask the union of a few seeds.
    kinds = {item.kind for item in inputs}
    for seed in (4, 5):
        kinds |= {item.kind for item in draw_inputs(start_inputs(SMALL_LIMITS), 300, seed=seed)}
    assert {"start.object", "start.binary", "start.oversize", "start.mutated"} <= kinds
    for item in inputs:
        if isinstance(item.wire, str):
            item.wire.encode("utf-8")  # a text frame must be UTF-8: surrogates as escapes
        if item.kind == "start.oversize":
            assert wire_size(item.wire) > SMALL_LIMITS.max_start_bytes
        if item.kind == "start.near-limit":
            assert wire_size(item.wire) <= SMALL_LIMITS.max_start_bytes
    assert any(isinstance(item.wire, bytes) for item in inputs)
    assert any("\\ud" in item.wire for item in inputs if isinstance(item.wire, str))


def test_control_inputs_cover_interactions_pings_and_stops() -> None:
    inputs = draw_inputs(control_inputs(SMALL_LIMITS), 300, seed=5)
    kinds = {item.kind for item in inputs}
    assert {"control.interaction", "control.ping", "control.binary", "control.oversize"} <= kinds
    valid = 0
    for item in inputs:
        try:
            message = protocol.parse_control(item.wire, limits=SMALL_LIMITS)
        except protocol.ProtocolError:
            continue
        valid += isinstance(message, protocol.Interaction)
    assert valid > 30  # enough reach the engine


def test_to_json_escapes_lone_surrogates_and_splices_raw_text() -> None:
    text = to_json({"p": "a\udc80", "n": Raw("NaN"), "e": "\u00e9"}, ascii=False)
    assert text == '{"p":"a\\udc80","n":NaN,"e":"\u00e9"}'
    text.encode("utf-8")


def test_control_inputs_cover_input_frames_as_they_claim_to_be() -> None:
    inputs = draw_inputs(control_inputs(SMALL_LIMITS), 300, seed=5)
    frames = [item for item in inputs if item.kind.startswith("control.frame-")]
    assert len(frames) > 30 and all(isinstance(item.wire, bytes) for item in frames)
    assert any(item.kind == "control.input-end" for item in inputs)
    cap = SMALL_LIMITS.max_input_frame_bytes
    variants = set()
    for item in frames:
        variant, _, frame_format = item.kind.removeprefix("control.frame-").partition(".")
        variants.add(variant)
        wire = item.wire
        assert isinstance(wire, bytes)
        if variant == "oversize":
            assert len(wire) > cap
        else:
            assert len(wire) <= cap
        if variant in ("valid", "padded"):
            vet_frame(wire, frame_format, CONTROL_SIZE, CONTROL_SIZE)  # a frame it takes
        if variant in ("wrong-size", "truncated"):
            with pytest.raises(EncodingError):
                vet_frame(wire, frame_format, CONTROL_SIZE, CONTROL_SIZE)
    assert {"valid", "padded", "oversize", "wrong-size", "truncated", "corrupt"} <= variants


def test_starts_carry_input_video_valid_and_not() -> None:
    blocks = []
    for item in draw_inputs(start_inputs(SMALL_LIMITS), 600, seed=3):
        try:
            message = json.loads(item.wire)
        except (ValueError, RecursionError):
            continue
        if isinstance(message, dict) and isinstance(message.get("input_video"), dict):
            blocks.append(message["input_video"])
    assert len(blocks) > 10
    assert any(block.get("frame_format") in ("jpeg", "png", "webp") for block in blocks)
    assert any("v2v_strength" in block for block in blocks)

"""The fuzz's inputs (``bench/_fuzz/strategies.py`` and the ``values.py`` and ``objects.py``
they are made of, ``bench/_fuzz/wire.py``): sendable, varied, reproducible from the seed,
reaching the engine often enough.
"""

from __future__ import annotations

from bench._fuzz.strategies import control_inputs, draw_inputs, start_inputs
from bench._fuzz.wire import Raw, to_json, wire_size
from trio_vstream import protocol

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

"""Hypothesis strategies for what a client sends, and drawing them.

The messages as sent: the objects of ``objects`` as JSON text (non-ASCII escaped or not),
broken in one place (``mutated``), as binary frames in other encodings, padded to just
over or within the size limits in 1- to 4-byte characters, nested too deep; and raw text,
empty messages. Input video frames (``frame_inputs``): pictures of the control session's
size in each format, valid, padded to the byte cap or past it, of other sizes, truncated,
corrupted, or garbage; and ``input_video.end``. ``start_inputs`` and ``control_inputs``
weigh these per phase, and ``draw_inputs`` draws them reproducibly from a seed.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any, Final

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from bench._frames import encoded_frame
from bench._fuzz.objects import (
    WRONG_CONTROL,
    interaction_objects,
    start_fields,
    start_objects,
    with_junk,
)
from bench._fuzz.settings import CONTROL_SIZE
from bench._fuzz.values import JSON_ANY, NON_OBJECTS, deep_values, weighted
from bench._fuzz.wire import (
    FuzzInput,
    Padded,
    PaddedFrame,
    Wire,
    to_json,
)
from trio_vstream import protocol

ASCII: Final = weighted((3, st.just(True)), (1, st.just(False)))


@st.composite
def json_texts(draw: st.DrawFn, values: SearchStrategy[Any]) -> str:
    """A value as JSON text, with non-ASCII characters escaped or not."""
    return to_json(draw(values), ascii=draw(ASCII))


MUTATIONS: Final = (
    "truncate",
    "delete",
    "insert",
    "single-quotes",
    "trailing",
    "leading",
    "duplicate-key",
    "wrap-array",
)


@st.composite
def mutated(draw: st.DrawFn, texts: SearchStrategy[str]) -> str:
    """Valid JSON text broken in one place, the way buggy clients and proxies break it."""
    text = draw(texts)
    op = draw(st.sampled_from(MUTATIONS))
    at = draw(st.integers(0, len(text)))
    if op == "truncate":
        return text[:at]
    if op == "delete":
        return text[:at] + text[at + 1 :]
    if op == "insert":
        char = draw(weighted((2, st.sampled_from(list('{}[]",:\\ \x00'))), (1, st.characters())))
        return text[:at] + char + text[at:]
    if op == "single-quotes":
        return text.replace('"', "'")
    if op == "trailing":
        return text + draw(st.sampled_from([",", "}", " x", "\x00", "{}", "\n\n", "//"]))
    if op == "leading":
        return draw(st.sampled_from(["\ufeff", " ", "\x00", "[", ")]}'\n"])) + text
    if op == "duplicate-key" and text.startswith("{") and len(text) > 2:
        key = draw(st.sampled_from(["type", "prompt", "interaction", "width"]))
        return "{" + json.dumps(key) + ":" + to_json(draw(JSON_ANY)) + "," + text[1:]
    return "[" + text + "]"


RAW_TEXTS: Final = weighted(
    (2, st.text(max_size=64)),
    (
        1,
        st.sampled_from(
            [
                "hello",
                "{",
                "}",
                '"',
                "{'type':'session.start','prompt':'a'}",
                "session.start",
                '{"type":"session.start"',
                '{"type":"session.ping"} {"type":"session.ping"}',
                "\x00",
            ]
        ),
    ),
)
EMPTY_TEXTS: Final = st.sampled_from(["", " ", "\n", "\x00", "{}", "[]", "null"])


def binary_frames(texts: SearchStrategy[str]) -> SearchStrategy[bytes]:
    """Binary frames: the same JSON as UTF-8 (which a server may accept), other
    encodings, invalid UTF-8 (CESU-8 surrogates, overlong forms), noise, nothing."""
    return weighted(
        (3, texts.map(lambda text: text.encode("utf-8"))),
        (2, st.binary(max_size=64)),
        (
            1,
            st.sampled_from(
                [b"", b"\xff", b"\xed\xa0\x80", b"\xc0\x80", b"\xef\xbb\xbf{}", b"\x00", b"\xc3"]
            ),
        ),
        (1, texts.map(lambda text: text.encode("utf-16"))),
        (1, texts.map(lambda text: b"\xef\xbb\xbf" + text.encode("utf-8"))),
        (1, texts.map(lambda text: text.encode("utf-8") + b"\xff")),
    )


PAD_MARKER: Final = "PAD-7f3c9e1d-PAD"


@st.composite
def sized(
    draw: st.DrawFn,
    objects: SearchStrategy[dict[str, Any]],
    limit: int,
    pad_key: str,
    *,
    over: bool,
) -> Padded:
    """A message padded to just over (or within) ``limit`` bytes, in 1- to 4-byte
    characters, so that a check that counts characters instead of bytes shows."""
    message = dict(draw(objects))
    unit = draw(st.sampled_from(["a", "a", "\u00e9", "\u20ac", "\U0001f600"]))
    if over:
        excess = draw(
            weighted(
                (6, st.integers(1, 4096)),
                (2, st.integers(1, limit)),
                (1, st.integers(limit + 1, limit + 4096)),  # past 2x: trio-websocket's 1009
            )
        )
        target = limit + excess
    else:
        target = limit - draw(weighted((3, st.integers(0, 64)), (2, st.integers(0, limit // 2))))
    message[pad_key] = PAD_MARKER
    head, _, tail = to_json(message, ascii=False).partition(PAD_MARKER)
    skeleton = len(head.encode("utf-8")) + len(tail.encode("utf-8"))
    unit_bytes = len(unit.encode("utf-8"))
    need = max(0, target - skeleton)
    count = -(-need // unit_bytes) if over else need // unit_bytes
    return Padded(head, unit, count, tail, binary=draw(st.integers(0, 3)) == 0)


@st.composite
def deep_messages(
    draw: st.DrawFn, objects: SearchStrategy[dict[str, Any]], host_keys: Sequence[str], limit: int
) -> str:
    """Deep nesting as the whole message, or as one field of an otherwise valid one."""
    value = draw(deep_values(limit))
    if draw(st.booleans()):
        return value.text
    message = dict(draw(objects))
    message[draw(st.sampled_from(host_keys))] = value
    return to_json(message)


WRONG_FRAME_SIZES: Final = ((2, 2), (32, 32), (62, 64), (64, 62), (66, 64), (64, 128), (128, 128))
"""Frame sizes other than the control session's (even: 4:2:0 encoders want them so)."""
PICTURES: Final = st.integers(0, 63)
"""Which picture a frame shows, each encoded once (`encoded_frame`): as many as make
distinct valid frames (the draw drops repeats)."""


@st.composite
def truncated_frames(draw: st.DrawFn, frames: SearchStrategy[bytes]) -> bytes:
    """A frame cut short: its header may be whole, its end never is."""
    data = draw(frames)
    return data[: draw(st.integers(1, len(data) - 1))]


@st.composite
def corrupted_frames(draw: st.DrawFn, frames: SearchStrategy[bytes]) -> bytes:
    """A frame with a few bytes flipped past its first quarter: the header mostly holds,
    the picture does not (a PNG's checksums fail in the decoder, after the vetting)."""
    data = bytearray(draw(frames))
    for _ in range(draw(st.integers(1, 8))):
        data[draw(st.integers(len(data) // 4, len(data) - 3))] ^= draw(st.integers(1, 255))
    return bytes(data)


def _frame_of_shape(frame_format: str, shape: tuple[int, int], number: int) -> bytes:
    return encoded_frame(frame_format, shape[0], shape[1], number)


def frame_inputs(limits: protocol.Limits) -> list[tuple[int, str, SearchStrategy[Any]]]:
    """Input video frames, as binary messages, and ``input_video.end``: kinds
    ``frame-<variant>.<format>`` (what a frame is, for `oracle.frame_expectation`).

    Each format's pictures at the control session's size (valid: what the session takes
    when it declared that format), padded with zeros to just within the byte cap or past
    it, at other sizes, cut short, corrupted; and garbage, never an image."""
    cap = limits.max_input_frame_bytes
    options: list[tuple[int, str, SearchStrategy[Any]]] = []
    for frame_format in protocol.INPUT_FRAME_FORMATS:
        size = CONTROL_SIZE
        valid = st.builds(functools.partial(encoded_frame, frame_format, size, size), PICTURES)
        wrong = st.builds(
            functools.partial(_frame_of_shape, frame_format),
            st.sampled_from(WRONG_FRAME_SIZES),
            PICTURES,
        )
        options += [
            (4, f"frame-valid.{frame_format}", valid),
            (
                1,
                f"frame-padded.{frame_format}",
                st.builds(PaddedFrame, valid, st.integers(cap - 4096, cap)),
            ),
            (1, f"frame-wrong-size.{frame_format}", wrong),
            (1, f"frame-truncated.{frame_format}", truncated_frames(valid)),
            (1, f"frame-corrupt.{frame_format}", corrupted_frames(valid)),
        ]
    jpeg = st.builds(functools.partial(encoded_frame, "jpeg", CONTROL_SIZE, CONTROL_SIZE), PICTURES)
    options += [
        (2, "frame-oversize.jpeg", st.builds(PaddedFrame, jpeg, st.integers(cap + 1, cap + 65536))),
        # A first byte that starts no image format: refused from its header.
        (1, "frame-garbage", st.binary(max_size=256).map(lambda data: b"\x00" + data)),
        (2, "input-end", st.just(protocol.INPUT_END_MESSAGE)),
    ]
    return options


def _inputs(
    kind_prefix: str, *options: tuple[int, str, SearchStrategy[Wire | Padded | PaddedFrame]]
) -> SearchStrategy[FuzzInput]:
    return weighted(
        *(
            (weight, strategy.map(functools.partial(FuzzInput, f"{kind_prefix}.{kind}")))
            for weight, kind, strategy in options
        )
    )


def start_inputs(limits: protocol.Limits) -> SearchStrategy[FuzzInput]:
    """What a client may send as its first message."""
    objects = start_objects(start_fields(limits))
    texts = json_texts(objects)
    limit = limits.max_start_bytes
    hosts = ("prompt", "lora", "extra_params", "video_params", "sampling_params", "user")
    return _inputs(
        "start",
        (70, "object", texts),
        (4, "non-object", json_texts(NON_OBJECTS)),
        (6, "mutated", mutated(texts)),
        (2, "text", RAW_TEXTS),
        (3, "deep", deep_messages(objects, hosts, limit)),
        (7, "binary", binary_frames(texts)),
        (2, "empty", EMPTY_TEXTS),
        (3, "oversize", sized(objects, limit, "prompt", over=True)),
        (2, "near-limit", sized(objects, limit, "prompt", over=False)),
    )


def control_inputs(limits: protocol.Limits) -> SearchStrategy[FuzzInput]:
    """What a client may send inside a running session."""
    interactions = interaction_objects(limits)
    pings = with_junk({"type": "session.ping"})
    stops = with_junk({"type": "session.stop"})
    objects = weighted((4, interactions), (1, pings), (1, WRONG_CONTROL))
    texts = json_texts(objects)
    limit = limits.max_control_bytes
    keepers = weighted((3, interactions), (1, pings))
    return _inputs(
        "control",
        (40, "interaction", json_texts(interactions)),
        (12, "ping", json_texts(pings)),
        (1, "stop", json_texts(stops)),
        (10, "wrong-type", json_texts(WRONG_CONTROL)),
        (4, "non-object", json_texts(NON_OBJECTS)),
        (6, "mutated", mutated(texts)),
        (2, "text", RAW_TEXTS),
        (3, "deep", deep_messages(objects, ("interaction", "padding", "type"), limit)),
        (9, "binary", binary_frames(texts)),
        (2, "empty", EMPTY_TEXTS),
        (3, "oversize", sized(keepers, limit, "padding", over=True)),
        (2, "near-limit", sized(keepers, limit, "padding", over=False)),
        *frame_inputs(limits),
    )


def draw_inputs(strategy: SearchStrategy[FuzzInput], count: int, seed: int) -> list[FuzzInput]:
    """``count`` distinct examples of ``strategy``: the same ones for the same count and seed.

    A ``@given`` function run directly collects what Hypothesis generates (generate phase
    only: no database, no shrinking). Hypothesis mutates earlier examples to make new ones,
    so some come out equal; those are dropped, and it runs again with a derived seed until
    there are enough.
    """
    found: dict[Wire | Padded | PaddedFrame, FuzzInput] = {}
    for attempt in range(20):
        if len(found) >= count:
            break

        @settings(
            database=None,
            max_examples=count - len(found) + 16,
            phases=[Phase.generate],
            deadline=None,
            suppress_health_check=list(HealthCheck),
            verbosity=Verbosity.quiet,
        )
        @hypothesis_seed(seed * 1009 + attempt)
        @given(strategy)
        def collect(item: FuzzInput) -> None:
            found.setdefault(item.payload, item)

        collect()
    return list(found.values())[:count]

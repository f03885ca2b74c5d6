"""The fuzz's JSON values: the alphabet every message is drawn from.

Hostile text (lone surrogates, control and astral characters, strings that mean something
elsewhere), boundary numbers (around the limits, past 64 bits, past Python's digit
limit, NaN and Infinity as raw JSON), any JSON value, and nesting deep enough to reach
the interpreter's recursion limit; with ``weighted``, the choice between strategies that
every table of the fuzz is made with. The objects built from them are in ``objects``,
the messages as sent in ``strategies``.
"""

from __future__ import annotations

from typing import Any, Final

import attrs
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from bench._fuzz.wire import Raw
from trio_vstream import protocol

START_FIELDS: Final = tuple(field.name for field in attrs.fields(protocol.VideoRequest))
"""The real ``session.start`` field names, from the protocol's own request model."""
NAMES: Final = (
    *START_FIELDS,
    "type",
    "format",
    "sampling_params",
    "interaction",
    "event",
    "event_id",
    "transition_chunks",
)


def weighted(*options: tuple[int, SearchStrategy[Any]]) -> SearchStrategy[Any]:
    """Hypothesis' ``one_of`` picks branches about evenly; a fuzz wants most inputs
    near-valid (or every one dies at the first check) and some of everything else."""
    table = [strategy for weight, strategy in options for _ in range(weight)]
    return st.sampled_from(table).flatmap(lambda strategy: strategy)


SURROGATES: Final = st.integers(0xD800, 0xDFFF).map(chr)
CONTROLS: Final = st.one_of(
    st.integers(0, 0x1F).map(chr),
    st.sampled_from(["\x7f", "\x85", "\u2028", "\u2029", "\ufeff", "\u200b", "\u202e", "\uffff"]),
)
ASTRAL: Final = st.integers(0x10000, 0x10FFFF).map(chr)
HOSTILE_CHARS: Final = weighted((3, st.characters()), (1, SURROGATES), (1, CONTROLS), (1, ASTRAL))
INTERESTING_STRINGS: Final = (
    "",
    " ",
    "\t\n",
    "null",
    "0",
    "-1",
    "NaN",
    "Infinity",
    "session.start",
    "m4s",
    "synthetic",
    "64x64",
    "\u0664",  # ARABIC-INDIC DIGIT FOUR
    "\x00",
    "\\",
    '"',
    "\udc80",
    "\ud83d",
    "\ud83d\ude00",
    "a\udc80b",
    "%s%n%x",
    "../../etc/passwd",
    "data:image/png;base64,",
    "\u202eevil",
)
TEXT_SHORT: Final = weighted(
    (4, st.text(max_size=16)),
    (2, st.text(alphabet=HOSTILE_CHARS, max_size=12)),
    (2, st.sampled_from(INTERESTING_STRINGS)),
)


def long_texts(min_repeat: int, max_repeat: int) -> SearchStrategy[str]:
    """A short unit repeated: long strings without long Hypothesis draws (which overrun)."""
    units = st.text(alphabet=HOSTILE_CHARS, min_size=1, max_size=3)
    return st.builds(lambda unit, count: unit * count, units, st.integers(min_repeat, max_repeat))


BOUNDARY_INTS: Final = (
    0,
    1,
    -1,
    2,
    255,
    256,
    1920,
    1921,
    2400,
    2401,
    2**31 - 1,
    2**31,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63),
    10**20,
    10**100,
    10**4000,  # parses (Python's limit is 4300 digits), then has to be range-checked
)
INTS: Final = weighted(
    (4, st.integers(-10, 300)), (2, st.integers()), (2, st.sampled_from(BOUNDARY_INTS))
)
FLOATS: Final = weighted(
    (3, st.floats(allow_nan=False, allow_infinity=False)),
    (1, st.sampled_from([0.0, -0.0, 0.5, 1.5, 2.0, 20.0, 20.000000000000004, 5e-324, 1.7e308])),
)
SPECIAL_NUMBERS: Final = st.sampled_from(
    [
        "NaN",
        "-NaN",
        "Infinity",
        "-Infinity",
        "1e400",
        "-1e400",
        "1e-400",
        "-0",
        "1E2",
        "1" + "0" * 5000,  # over Python's int digit limit
        "0." + "0" * 5000 + "1",
        "01",
        "+1",
        ".5",
        "1.",
        "0x10",
    ]
).map(Raw)
JSON_KEYS: Final = weighted((2, st.sampled_from(NAMES)), (2, TEXT_SHORT))
JSON_LEAVES: Final = weighted(
    (1, st.none()),
    (1, st.booleans()),
    (3, INTS),
    (2, FLOATS),
    (1, SPECIAL_NUMBERS),
    (4, TEXT_SHORT),
)
JSON_ANY: Final = st.recursive(
    JSON_LEAVES,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(JSON_KEYS, children, max_size=4)
    ),
    max_leaves=8,
)
NON_OBJECTS: Final = st.one_of(
    JSON_LEAVES, st.lists(JSON_ANY, max_size=4), st.sampled_from([[], [{}], ""])
)


def nested(depth: int, shape: str) -> Raw:
    """``depth`` levels of arrays or objects: Python's JSON parser recurses per level."""
    if shape == "[":
        return Raw("[" * depth + "]" * depth)
    if shape == "{":
        return Raw('{"a":' * depth + "1" + "}" * depth)
    return Raw('[{"a":' * depth + "1" + "}]" * depth)


def deep_values(limit: int) -> SearchStrategy[Raw]:
    """Depths around the interpreter's recursion limit (1000) matter most: they parse,
    and then whatever walks or re-serialises the value may not."""
    most = max(2, limit // 8)
    depths = weighted(
        (3, st.integers(1, 64)),
        (3, st.integers(min(400, most), min(1100, most))),
        (2, st.integers(min(1100, most), min(20000, most))),
        (1, st.integers(min(20000, most), most)),
    )
    return st.builds(nested, depths, st.sampled_from(["[", "{", "[{"]))

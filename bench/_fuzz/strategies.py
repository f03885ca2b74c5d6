"""Hypothesis strategies for ``session.start`` and control messages, and drawing them.

Mostly near-valid values built from the protocol's real field names, and some of
everything else (wrong types, boundary numbers, lone surrogates, broken JSON, binary
frames, sizes around the limits): an input that fails the first check tests only that
check. One module, about 790 lines: the strategies are a single table of choices that
reads best in one place, and splitting it would only scatter the weights.
"""

from __future__ import annotations

import base64
import functools
import json
import struct
import zlib
from collections.abc import Sequence
from typing import Any, Final

import attrs
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from bench._fuzz.settings import (
    FAULT_KEYS,
    SERVED_MODEL,
)
from bench._fuzz.wire import (
    ABSENT,
    FuzzInput,
    Padded,
    Raw,
    Wire,
    to_json,
)
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


def _png(width: int, height: int, *, pixels: bool = True) -> bytes:
    """A PNG file; without pixels, one whose header claims the size but holds no image."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    rows = b"".join(b"\x00" + b"\x80\x40\x20" * width for _ in range(height)) if pixels else b""
    body = chunk(b"IDAT", zlib.compress(rows)) if pixels else chunk(b"IDAT", b"\x78\x9c")
    return b"\x89PNG\r\n\x1a\n" + header + body + chunk(b"IEND", b"")


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


TINY_PNG: Final = _png(2, 2)
IMAGE_URLS: Final = (
    _data_url(TINY_PNG),
    "DATA:IMAGE/PNG;BASE64," + base64.b64encode(TINY_PNG).decode(),
    "data:image/png;base64,\n" + base64.encodebytes(TINY_PNG).decode(),
    _data_url(_png(30000, 30000, pixels=False)),  # claims 900 Mpixel
    _data_url(TINY_PNG[:20]),
    "data:image/png;base64,",
    "data:image/png;base64,!!!!",
    "data:image/png;base64,AAAA",
    "data:image/png;base64,AAA",
    "data:text/plain;base64,aGVsbG8=",
    "data:image/png,rawdata",
    "data:;base64,AAAA",
    _data_url(b"<svg xmlns='http://www.w3.org/2000/svg' width='2' height='2'/>", "image/svg+xml"),
    # Formats that tell FFmpeg to open other files: must not be followed.
    _data_url(b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nfile:///etc/passwd\n"),
    _data_url(b"ffconcat version 1.0\nfile '/etc/passwd'\n"),
    "http://127.0.0.1:9/x.png",
    "file:///etc/passwd",
    "/etc/passwd",
    "",
)
IMAGE_REFERENCES: Final = weighted(
    (4, st.sampled_from(IMAGE_URLS).map(lambda url: {"image_url": url})),
    (2, st.binary(max_size=64).map(lambda data: {"image_url": _data_url(data)})),
    (
        1,
        st.sampled_from(
            [
                {"file_id": "file-1"},
                {},
                {"image_url": None},
                {"image_url": 5},
                {"image_url": _data_url(TINY_PNG), "file_id": "file-1"},
                {"url": _data_url(TINY_PNG)},
            ]
        ),
    ),
)
CODEC_KEYS: Final = (
    "preset",
    "tune",
    "crf",
    "qp",
    "profile",
    "g",
    "bf",
    "x264-params",
    "x264opts",
    "threads",
    "level",
    "refs",
    "b",
    "pix_fmt",
    "forced-idr",
)
CODEC_VALUES: Final = (
    "ultrafast",
    "zerolatency",
    "film",
    "0",
    "23",
    "51",
    "52",
    "-1",
    "baseline",
    "high",
    "high444",
    "keyint=1",
    "keyint=1:bframes=3",
    "16",
    "99999",
    "abc",
    "",
    "1e9",
    "yuv444p",
)
CODEC_OPTIONS: Final = st.dictionaries(
    weighted((3, st.sampled_from(CODEC_KEYS)), (1, TEXT_SHORT)),
    weighted(
        (3, st.sampled_from(CODEC_VALUES)),
        (1, st.integers(-10, 100)),
        (1, st.floats(-1e3, 1e3)),
        (1, JSON_ANY),
    ),
    max_size=3,
)
EXTRA_PARAMS: Final = weighted(
    (3, st.just({})),
    (3, CODEC_OPTIONS.map(lambda options: {"video_codec_options": options})),
    (
        1,
        st.builds(
            lambda key, value: {key: value},
            st.sampled_from(FAULT_KEYS),
            weighted((3, st.integers(0, 3)), (1, st.sampled_from([-1, 2**63, 1.0, True]))),
        ),
    ),
    (2, st.dictionaries(JSON_KEYS, JSON_ANY, max_size=3)),
)
WRONG_START_TYPES: Final = (
    "session.stop",
    "session.ping",
    "session.interaction",
    "SESSION.START",
    "session.start ",
    "",
    "video.start",
)
TYPO_KEYS: Final = ("promt", "widht", "num_frame", "Prompt", "seed ", "samplingparams", "")
SIZE_STRINGS: Final = (
    "0x0",
    "64X64",
    "64x",
    "x64",
    "64*64",
    "64x64x64",
    "\u0666\u0664x\u0666\u0664",
    "0064x0064",
    "99999999999999x2",
    "2x2",
    " 64x64",
    "1920x1920",
    "1921x2",
)


def start_fields(limits: protocol.Limits) -> dict[str, SearchStrategy[Any]]:
    """Valid-ish values per ``session.start`` field: mostly accepted, often just not."""
    even = st.integers(1, 128).map(lambda n: 2 * n)
    dimension = weighted(
        (8, even),
        (
            2,
            st.sampled_from(
                [0, 1, -2, 3, 255, limits.max_width, limits.max_width + 1, 2**31, 2**63, 10**13]
            ),
        ),
        (1, st.sampled_from([64.0, "64", True, None])),
    )
    frames = weighted(
        (8, st.integers(1, 48)),
        (2, st.sampled_from([0, -1, limits.max_num_frames, limits.max_num_frames + 1, 2**40])),
        (1, st.sampled_from([48.0, "48", False])),
    )
    fps = weighted((6, st.integers(1, 60)), (1, st.sampled_from([0, -1, 2**31, 10**6, 24.0])))
    scale = weighted(
        (3, st.floats(0, 20)),
        (1, st.sampled_from([-1e-9, 20.000001, -0.0, 20.0, 200.0])),
        (1, SPECIAL_NUMBERS),
    )
    flag = weighted((4, st.just(False)), (1, st.just(True)), (1, st.sampled_from([0, 1, "false"])))
    return {
        "prompt": weighted(
            (6, st.text(min_size=1, max_size=40)), (2, TEXT_SHORT), (1, long_texts(100, 5000))
        ),
        "model": weighted((4, st.just(SERVED_MODEL)), (1, TEXT_SHORT)),
        "format": weighted((4, st.just("m4s")), (1, st.sampled_from(["mp4", "M4S", "", "m4s "]))),
        "seconds": weighted(
            (3, st.sampled_from(["1", "2", "4"])),
            (2, st.sampled_from(["0", "-1", "1.5", " 4", "\u0664", "01", "9" * 13])),
            (1, st.integers(0, 5)),
        ),
        "size": weighted(
            (6, st.builds(lambda w, h: f"{w}x{h}", even, even)),
            (2, st.sampled_from(SIZE_STRINGS)),
        ),
        "width": dimension,
        "height": dimension,
        "fps": fps,
        "num_frames": frames,
        "video_params": weighted(
            (
                3,
                st.fixed_dictionaries(
                    {},
                    optional={
                        "width": dimension,
                        "height": dimension,
                        "num_frames": frames,
                        "fps": fps,
                    },
                ),
            ),
            (1, st.dictionaries(JSON_KEYS, JSON_ANY, max_size=3)),
        ),
        "image_reference": IMAGE_REFERENCES,
        "user": TEXT_SHORT,
        "negative_prompt": weighted((3, st.text(max_size=30)), (1, st.none()), (1, TEXT_SHORT)),
        "num_inference_steps": weighted(
            (3, st.integers(1, 200)), (1, st.sampled_from([0, 201, -1, 1.0, 2**63]))
        ),
        "guidance_scale": scale,
        "guidance_scale_2": scale,
        "true_cfg_scale": scale,
        "boundary_ratio": weighted(
            (3, st.floats(0, 1)), (1, st.sampled_from([-1e-9, 1.0000001, 1, 0]))
        ),
        "flow_shift": FLOATS,
        "seed": weighted((3, st.integers(0, 2**32)), (2, INTS)),
        "quality": st.sampled_from(["lossless", "high", "low", "HIGH", ""]),
        "generate_sound": flag,
        "sound_duration": weighted((2, st.floats(0.1, 10)), (1, st.sampled_from([0, -1, 0.0]))),
        "enable_frame_interpolation": flag,
        "frame_interpolation_exp": weighted((2, st.integers(1, 4)), (1, st.sampled_from([0, -1]))),
        "frame_interpolation_scale": weighted(
            (2, st.floats(0.1, 4)), (1, st.sampled_from([0, -0.5]))
        ),
        "frame_interpolation_model_path": TEXT_SHORT,
        "lora": weighted(
            (2, st.dictionaries(TEXT_SHORT, JSON_ANY, max_size=3)),
            (1, deep_values(limits.max_start_bytes)),
        ),
        "extra_params": EXTRA_PARAMS,
    }


START_TYPES: Final = weighted(
    (30, st.just("session.start")),
    (1, st.just(ABSENT)),
    (1, st.sampled_from(WRONG_START_TYPES)),
    (1, JSON_ANY),
)
EXTRA_KEYS: Final = weighted((1, st.sampled_from(TYPO_KEYS)), (1, TEXT_SHORT))


def start_objects(fields: dict[str, SearchStrategy[Any]]) -> SearchStrategy[dict[str, Any]]:
    """A ``session.start`` object: real field names, each value valid-ish or anything."""
    # Built once: making strategies inside a draw costs more than drawing from them.
    values = {name: weighted((9, fields.get(name, JSON_ANY)), (1, JSON_ANY)) for name in NAMES}
    optional = st.lists(
        st.sampled_from([n for n in (*START_FIELDS, "format", "sampling_params") if n != "prompt"]),
        max_size=5,
        unique=True,
    )
    lifted_keys = st.lists(
        st.sampled_from((*START_FIELDS, "steps", "foo", *FAULT_KEYS)), max_size=3, unique=True
    )
    odds = st.integers(0, 19)

    def value(draw: st.DrawFn, name: str) -> Any:
        return draw(values.get(name, JSON_ANY))

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        message: dict[str, Any] = {}
        kind = draw(START_TYPES)
        if kind is not ABSENT:
            message["type"] = kind
        if draw(odds):
            message["prompt"] = value(draw, "prompt")
        for name in draw(optional):
            if name == "sampling_params" and draw(odds):
                message[name] = {key: value(draw, key) for key in draw(lifted_keys)}
            else:
                message[name] = value(draw, name)
        if not draw(odds):
            message[draw(EXTRA_KEYS)] = draw(JSON_ANY)
        return message

    return build()


INTERACTION_TYPES: Final = weighted(
    (30, st.just("session.interaction")),
    (1, st.just(ABSENT)),
    (1, st.sampled_from(["session.Interaction", "session.interaction ", "interaction"])),
    (1, JSON_ANY),
)
EVENT_IDS: Final = weighted(
    (4, st.just(ABSENT)),
    (6, st.text(min_size=1, max_size=12)),
    (2, st.sampled_from(["e1", "e2", "dup"])),  # conflicts
    (1, TEXT_SHORT),
    (1, JSON_ANY),
)
NEGATIVE_PROMPTS: Final = weighted((1, st.none()), (1, TEXT_SHORT), (1, JSON_ANY))
TRANSITION_CHUNKS: Final = weighted(
    (6, st.just(ABSENT)),
    (6, st.integers(0, 8)),
    (
        2,
        st.sampled_from([-1, 2.0, 2.5, 0.0, -0.0, 1e300, 10**30, 2**63, 10**4000, True, "3", None]),
    ),
    (1, JSON_ANY),
)
MOSTLY: Final = weighted((12, st.just(True)), (1, st.just(False)), (1, st.just(ABSENT)))
"""Keep the valid-ish value (True), replace it with anything (False), or leave it out."""


def interaction_objects(limits: protocol.Limits) -> SearchStrategy[dict[str, Any]]:
    """A ``session.interaction``: event id, event.prompt and transition_chunks, each
    valid-ish (a small pool of ids gives event_id conflicts) or anything."""
    prompts = weighted(
        (8, st.text(min_size=1, max_size=30)),
        (2, TEXT_SHORT),
        (1, long_texts(100, max(100, limits.max_control_bytes // 8))),
        (1, JSON_ANY),
    )
    odds = st.integers(0, 19)

    def keep(draw: st.DrawFn, valid: Any) -> Any:
        choice = draw(MOSTLY)
        return valid if choice is True else (draw(JSON_ANY) if choice is False else ABSENT)

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        message: dict[str, Any] = {}
        kind = draw(INTERACTION_TYPES)
        if kind is not ABSENT:
            message["type"] = kind
        interaction: dict[str, Any] = {}
        event_id = draw(EVENT_IDS)
        if event_id is not ABSENT:
            interaction["event_id"] = event_id
        event: dict[str, Any] = {"prompt": draw(prompts)} if draw(odds) > 1 else {}
        if draw(odds) < 2:
            event["negative_prompt"] = draw(NEGATIVE_PROMPTS)
        if draw(odds) == 0:
            event[draw(JSON_KEYS)] = draw(JSON_ANY)
        event_value = keep(draw, event)
        if event_value is not ABSENT:
            interaction["event"] = event_value
        transition = draw(TRANSITION_CHUNKS)
        if transition is not ABSENT:
            interaction["transition_chunks"] = transition
        body = keep(draw, interaction)
        if body is not ABSENT:
            message["interaction"] = body
        if draw(odds) == 0:
            message[draw(JSON_KEYS)] = draw(JSON_ANY)
        return message

    return build()


def _with_junk(message: dict[str, Any]) -> SearchStrategy[dict[str, Any]]:
    junk = st.dictionaries(JSON_KEYS.filter(lambda key: key != "type"), JSON_ANY, max_size=2)
    return weighted((2, st.just(message)), (1, junk.map(lambda extra: {**message, **extra})))


WRONG_CONTROL_TYPES: Final = (
    "session.start",
    "session.Ping",
    "ping",
    "session.stop ",
    "",
    "session.pong",
    "session.interaction.queued",
    "video.start",
    "error",
)
WRONG_CONTROL: Final = st.builds(
    lambda kind, extra: {"type": kind, **extra},
    weighted((3, st.sampled_from(WRONG_CONTROL_TYPES)), (1, TEXT_SHORT), (1, JSON_ANY)),
    st.dictionaries(JSON_KEYS.filter(lambda key: key != "type"), JSON_ANY, max_size=3),
) | st.dictionaries(JSON_KEYS.filter(lambda key: key != "type"), JSON_ANY, max_size=3)


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


def _inputs(
    kind_prefix: str, *options: tuple[int, str, SearchStrategy[Wire | Padded]]
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
    pings = _with_junk({"type": "session.ping"})
    stops = _with_junk({"type": "session.stop"})
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
    )


def draw_inputs(strategy: SearchStrategy[FuzzInput], count: int, seed: int) -> list[FuzzInput]:
    """``count`` distinct examples of ``strategy``: the same ones for the same count and seed.

    A ``@given`` function run directly collects what Hypothesis generates (generate phase
    only: no database, no shrinking). Hypothesis mutates earlier examples to make new ones,
    so some come out equal; those are dropped, and it runs again with a derived seed until
    there are enough.
    """
    found: dict[Wire | Padded, FuzzInput] = {}
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

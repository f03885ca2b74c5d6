#!/usr/bin/env python3
"""Hypothesis fuzz of the ``/v1/realtime/video`` protocol, against a real server process.

Why: the protocol's unit tests check the inputs someone thought of. This sends thousands
nobody did (wrong types in every field, huge and NaN-ish numbers, lone surrogates written
as ``\\udc80`` escapes, control characters, deep nesting, broken JSON, binary frames,
messages just under and just over the size limits) to a server started the way users
start it (``python -m trio_vstream --engine synthetic``, in a subprocess, on 127.0.0.1),
and checks what any correct server must do whatever it is sent:

* ``session.start`` (one fresh connection per input, since a rejected start ends the
  connection): the first reply is ``video.start`` or an ``error`` whose ``code`` is one of
  `protocol.ErrorCode`'s values, never ``internal_error``. An accepted session is
  stopped after its first chunk and must end with one terminal message, and not with
  ``generation_failed`` or ``encoding_failed`` unless it asked the synthetic engine for
  a fault: what the server accepts it must be able to generate. Every connection ends
  with a normal close (1000). A message over ``--max-start-bytes`` gets ``message_too_large``
  (or, beyond twice the limit, trio-websocket's documented 1009 close), one within it
  never does.
* control messages, sent one after another into one long-running session, each followed
  by a ``session.ping``: the input gets exactly one reply (``session.pong``,
  ``session.interaction.queued`` or an ``error`` with a per-message code), the ping its
  pong, and the session survives. Only a valid ``session.stop`` may end it; a session
  that ends with ``generation_failed`` (or any other error) after a control message is
  a violation, blamed on the interactions queued but not yet applied, each of which is
  then replayed alone in a fresh session to find the one that does it.
* every string in every server message encodes as UTF-8 (no lone surrogates after
  ``json.loads``), and every message is strict JSON with a ``type``;
* the server process stays up and answers ``GET /health`` (checked every
  `HEALTH_EVERY` inputs and at the end); afterwards ``/stats`` is back to no session,
  no engine stream and no worker thread, and SIGTERM ends it with status 0.

Hypothesis generates all inputs up front (the same ``--inputs`` and ``--seed``, the same
inputs): the strategies build JSON from the protocol's real field names with values that
are mostly valid and often not, because an input that fails the first check tests only
that check. Then Trio sends
them: start inputs over a few concurrent connections, control inputs in order. Each kind
of violation found is then shrunk to a small input that still shows it (greedy, on the
JSON value; Hypothesis' own shrinker would need the server inside the Hypothesis test).

    python bench/fuzz.py --inputs 2000 --seed 1 --json fuzz.json     # the CI form
    python bench/fuzz.py --inputs 10000 --seed 7                     # the long form

Exit status: 0 no violation; 1 violations (the summary shows each with its minimal
input); 2 usage error; 3 the run could not finish (server did not start, time limit).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import re
import struct
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final, TypeAlias

import attrs
import trio
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from trio_websocket import (
    ConnectionClosed,
    DisconnectionTimeout,
    HandshakeError,
    WebSocketConnection,
    open_websocket_url,
)

from trio_vstream import protocol

if __package__ in (None, ""):  # run as a script: make the `bench` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import run as bench

Wire: TypeAlias = str | bytes
"""One WebSocket message as sent: a text frame (str) or a binary frame (bytes)."""

KNOWN_CODES: Final = frozenset(code.value for code in protocol.ErrorCode)
PER_MESSAGE_CODES: Final = frozenset(
    {
        protocol.ErrorCode.INVALID_JSON.value,
        protocol.ErrorCode.INVALID_MESSAGE.value,
        protocol.ErrorCode.UNKNOWN_TYPE.value,
        protocol.ErrorCode.MESSAGE_TOO_LARGE.value,
        protocol.ErrorCode.EVENT_ID_CONFLICT.value,
        protocol.ErrorCode.INTERACTION_FAILED.value,
    }
)
"""Codes that answer one control message and leave the session running; any other known
code ends the session."""
ENGINE_FAILURE_CODES: Final = frozenset({"generation_failed", "encoding_failed"})
FAULT_KEYS: Final = ("fail_at_chunk", "hang_at_chunk")
"""``extra_params`` the synthetic engine takes as fault injections: with these, a failed
or stuck generation is what was asked for."""
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

ENGINE_ARGS: Final = (("steps", "2"), ("step_delay", "0.01"), ("chunk_frames", "4"))
"""A chunk every ~20 ms: the control session streams for seconds (2400 frames), and an
accepted start shows its first chunk soon enough to be checked."""
CONTROL_START: Final = protocol.start_message(
    "fuzz: control session", size="64x64", fps=24, num_frames=2400
)
SERVED_MODEL: Final = "synthetic"
CLIENT_MAX_MESSAGE: Final = 64 * 1024 * 1024
HEALTH_EVERY: Final = 250
"""Inputs between two ``GET /health`` checks (each phase counts its own)."""
START_TIMEOUT: Final = 30.0
"""Seconds one ``session.start`` input may take, up to its close; beyond, a violation."""
FIRST_CHUNK_WAIT: Final = 5.0
"""How long an accepted session may take to show its first chunk before it is stopped
anyway (slowness is not a violation; a missing terminal message is)."""
REPLY_TIMEOUT: Final = 10.0
"""Seconds a control message and its ping have to be answered."""
STUCK_AFTER: Final = 10.0
"""Seconds without a chunk after which a control session counts as stuck. Pings keep
the server's stall guard from noticing an engine that hangs, so the fuzz has to."""
SETTLE_CHUNKS: Final = 2
"""Chunks to wait for after a replayed control message: an interaction takes effect at
the next chunk boundary, so a failure it causes shows by then."""


def progress(message: str) -> None:
    bench.progress(f"fuzz: {message}")


# --------------------------------------------------------------------------------------
# JSON text that json.dumps cannot write
# --------------------------------------------------------------------------------------


@attrs.frozen
class Raw:
    """JSON text spliced in verbatim: ``NaN``, ``1e400``, 5000-digit numbers, deep
    nesting; what a hostile client can send but ``json.dumps`` will not write."""

    text: str


class _Absent:
    """Marks an optional field that a strategy left out."""


ABSENT: Final = _Absent()


_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def _has_surrogate(text: str) -> bool:
    return _SURROGATE.search(text) is not None


def to_json(value: Any, *, ascii: bool = True) -> str:
    """Serialise a fuzz value. Strings with lone surrogates are always written as
    ``\\udXXX`` escapes: a text frame must be UTF-8, so that is the only way to send them."""
    if isinstance(value, Raw):
        return value.text
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=ascii or _has_surrogate(value))
    if isinstance(value, list | tuple):
        return "[" + ",".join(to_json(item, ascii=ascii) for item in value) + "]"
    if isinstance(value, dict):
        items = (
            f"{to_json(str(k), ascii=ascii)}:{to_json(v, ascii=ascii)}" for k, v in value.items()
        )
        return "{" + ",".join(items) + "}"
    raise TypeError(f"not a fuzz JSON value: {type(value).__name__}")


def wire_size(wire: Wire) -> int:
    """Bytes on the wire, which is what the server's size limits count."""
    return len(wire) if isinstance(wire, bytes) else len(wire.encode("utf-8"))


# --------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------

SearchStrategy: TypeAlias = st.SearchStrategy


@attrs.frozen
class Padded:
    """``head + unit * count + tail``, built only when sent: size-limit inputs are
    megabytes each, and thousands of them held as strings would fill the memory."""

    head: str
    unit: str
    count: int
    tail: str
    binary: bool

    def build(self) -> Wire:
        text = self.head + self.unit * self.count + self.tail
        return text.encode("utf-8") if self.binary else text


@attrs.frozen
class FuzzInput:
    """One message to send, labelled with the strategy that made it (for the summary)."""

    kind: str
    payload: Wire | Padded

    @property
    def wire(self) -> Wire:
        payload = self.payload
        return payload.build() if isinstance(payload, Padded) else payload


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
            (weight, strategy.map(lambda wire, kind=kind: FuzzInput(f"{kind_prefix}.{kind}", wire)))
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


# --------------------------------------------------------------------------------------
# The oracle: pure functions over what the server sent
# --------------------------------------------------------------------------------------


@attrs.frozen
class Problem:
    """One way a server's answer broke the oracle; ``key`` names the kind."""

    key: str
    detail: str


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit] + f"...(+{len(text) - limit} chars)"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def lone_surrogates(value: Any, path: str = "$") -> list[str]:
    """JSON paths of the strings (keys included) that are not valid UTF-8."""
    found: list[str] = []
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            found.append(path)
    elif isinstance(value, dict):
        for key, item in value.items():
            found += lone_surrogates(key, f"{path}.<key {key!a}>")
            found += lone_surrogates(item, f"{path}.{key}" if isinstance(key, str) else path)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += lone_surrogates(item, f"{path}[{index}]")
    return found


def check_reply(raw: str) -> tuple[dict[str, Any] | None, list[Problem]]:
    """Parse one text message from the server and check it on its own."""
    try:
        message = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return None, [Problem("reply-not-json", _shorten(repr(raw)))]
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        return None, [Problem("reply-without-type", _shorten(repr(raw)))]
    problems = []
    bad = lone_surrogates(message)
    if bad:
        problems.append(Problem("reply-lone-surrogate", f"{message['type']}: {', '.join(bad[:5])}"))
    if message["type"] == "error":
        code = message.get("code")
        text = message.get("message")
        if not isinstance(code, str) or not code:
            problems.append(Problem("error-without-code", _shorten(repr(message))))
        elif code == protocol.ErrorCode.INTERNAL_ERROR:
            problems.append(Problem("internal-error", _shorten(repr(text))))
        elif code not in KNOWN_CODES:
            problems.append(Problem("unknown-code", _shorten(repr(code))))
        if not isinstance(text, str) or not text.strip():
            problems.append(Problem("error-without-message", _shorten(repr(message))))
    return message, problems


def _size_problems(outcome: str, sent: int, limit: int) -> list[Problem]:
    too_large = f"error:{protocol.ErrorCode.MESSAGE_TOO_LARGE.value}"
    if sent > limit and outcome not in (too_large, "closed-1009"):
        return [Problem("oversize-not-refused", f"{sent} bytes > {limit}: {outcome}")]
    if sent <= limit and outcome == too_large:
        return [Problem("refused-within-limit", f"{sent} bytes <= {limit}")]
    return []


@attrs.define
class StartTranscript:
    """Everything one ``session.start`` connection saw."""

    sent_bytes: int
    fault_injected: bool = False
    messages: list[Wire] = attrs.field(factory=list)
    close_code: int | None = None
    """None: the connection was still open when the input's time ran out."""
    timed_out: bool = False
    connect_error: str | None = None


def judge_start(transcript: StartTranscript, limit: int) -> tuple[str, list[Problem]]:
    """The outcome (``accepted``, ``error:<code>``, ``closed-1009`` or ``violation``)
    and the problems of one ``session.start`` input."""
    if transcript.connect_error is not None:
        return "violation", [Problem("connect-failed", transcript.connect_error)]
    problems: list[Problem] = []
    parsed: list[dict[str, Any] | bytes | None] = []
    for raw in transcript.messages:
        if isinstance(raw, bytes):
            parsed.append(raw)
            continue
        message, found = check_reply(raw)
        problems += found
        parsed.append(message)
    sent = transcript.sent_bytes
    if not parsed:
        if transcript.timed_out:
            problems.append(Problem("no-reply", f"nothing in {START_TIMEOUT:.0f} s"))
        elif transcript.close_code == 1009 and sent > 2 * limit:
            return "closed-1009", problems
        else:
            problems.append(
                Problem(
                    "closed-without-message", f"close {transcript.close_code}, {sent} bytes sent"
                )
            )
        return "violation", problems
    first = parsed[0]
    if not isinstance(first, dict):
        problems.append(Problem("unexpected-first-reply", "binary" if first else "unparsable"))
        return "violation", problems
    kind = first["type"]
    rest = parsed[1:]
    if kind == "video.start":
        outcome = "accepted"
        terminal = next(
            (
                i
                for i, m in enumerate(rest)
                if isinstance(m, dict) and m["type"] in ("session.done", "error")
            ),
            None,
        )
        expected = ("video.chunk_metadata", "session.pong")
        for message in rest[: terminal if terminal is not None else len(rest)]:
            if isinstance(message, dict) and message["type"] not in expected:
                problems.append(Problem("unexpected-reply", message["type"]))
        if terminal is None:
            how = "timed out" if transcript.timed_out else f"closed {transcript.close_code}"
            problems.append(Problem("no-terminal", f"accepted session ended without one: {how}"))
        else:
            end = rest[terminal]
            assert isinstance(end, dict)
            if rest[terminal + 1 :]:
                problems.append(Problem("message-after-terminal", f"{len(rest) - terminal - 1}"))
            code = end.get("code")
            if (
                end["type"] == "error"
                and code in ENGINE_FAILURE_CODES
                and not transcript.fault_injected
            ):
                problems.append(
                    Problem(f"accepted-then-{code}", _shorten(repr(end.get("message"))))
                )
    elif kind == "error":
        outcome = f"error:{first.get('code')}"
        if rest:
            problems.append(Problem("message-after-terminal", f"{len(rest)} after the error"))
    else:
        problems.append(Problem("unexpected-first-reply", kind))
        outcome = "violation"
    problems += _size_problems(outcome, sent, limit)
    if transcript.timed_out:
        if not any(p.key == "no-terminal" for p in problems):
            problems.append(Problem("no-close", f"still open after {START_TIMEOUT:.0f} s"))
    elif transcript.close_code != 1000:
        problems.append(Problem("abnormal-close", f"close code {transcript.close_code}"))
    return ("violation" if problems else outcome), problems


@attrs.define
class Exchange:
    """What one control message (and the ping after it) got back."""

    sent_bytes: int
    replies: list[dict[str, Any]] = attrs.field(factory=list)
    """Answers other than chunks, in order, before any terminal message."""
    terminal: dict[str, Any] | None = None
    close_code: int | None = None
    timed_out: bool = False
    problems: list[Problem] = attrs.field(factory=list)
    """Problems found in single messages (`check_reply`)."""
    messages: list[str] = attrs.field(factory=list)
    """The raw text messages other than chunk metadata, for the report."""


def is_terminal(message: dict[str, Any]) -> bool:
    """``session.done``, or an error whose code ends a session (not a per-message one)."""
    if message["type"] == "session.done":
        return True
    code = message.get("code")
    return message["type"] == "error" and code in KNOWN_CODES and code not in PER_MESSAGE_CODES


def judge_control(exchange: Exchange, limit: int, *, answers: int = 2) -> tuple[str, list[Problem]]:
    """The outcome (``pong``, ``queued``, ``error:<code>``, ``stopped``, ``completed``,
    ``closed-1009`` or ``violation``) and the problems of one control input.

    ``answers``: 2 for an input and its ping; 0 for a wait in which nothing was sent
    (outcome ``running`` while the session lives on).
    """
    problems = list(exchange.problems)
    sent = exchange.sent_bytes
    if exchange.terminal is not None:
        end = exchange.terminal
        if end["type"] == "session.done":
            outcome = "stopped" if end.get("stopped") is True else "completed"
        else:
            code = end.get("code")
            problems.append(Problem(f"session-ended-{code}", _shorten(repr(end.get("message")))))
            outcome = "violation"
        if exchange.close_code is None:
            problems.append(Problem("no-close", "no close after the terminal message"))
        elif exchange.close_code != 1000:
            problems.append(Problem("abnormal-close", f"close code {exchange.close_code}"))
        return ("violation" if problems else outcome), problems
    if exchange.close_code is not None:
        if exchange.close_code == 1009 and sent > 2 * limit:
            return ("violation" if problems else "closed-1009"), problems
        problems.append(
            Problem("closed-without-terminal", f"close {exchange.close_code}, {sent} bytes sent")
        )
        return "violation", problems
    if answers == 0:
        if exchange.replies:
            kinds = [reply["type"] for reply in exchange.replies]
            problems.append(Problem("unexpected-reply", f"unasked: {kinds}"))
        return ("violation" if problems else "running"), problems
    if len(exchange.replies) < 2:
        kinds = [reply["type"] for reply in exchange.replies]
        problems.append(
            Problem("no-reply", f"{len(kinds)} of 2 answers in {REPLY_TIMEOUT:.0f} s: {kinds}")
        )
        return "violation", problems
    first, second = exchange.replies[:2]
    if second["type"] != "session.pong":
        problems.append(Problem("reply-order", f"{first['type']} then {second['type']}"))
    kind = first["type"]
    if kind == "session.pong":
        outcome = "pong"
    elif kind == "session.interaction.queued":
        outcome = "queued"
    elif kind == "error":
        code = first.get("code")
        outcome = f"error:{code}"
        if code in KNOWN_CODES and code not in PER_MESSAGE_CODES:
            problems.append(Problem("unexpected-code", repr(code)))
    else:
        outcome = "violation"
        problems.append(Problem("unexpected-reply", kind))
    problems += _size_problems(outcome, sent, limit)
    return ("violation" if problems else outcome), problems


def fault_injected(wire: Wire) -> bool:
    """Whether a start asks the synthetic engine to fail or hang (then it may)."""
    try:
        message = json.loads(wire)
    except (ValueError, RecursionError):
        return False
    if not isinstance(message, dict):
        return False
    for block in (message.get("extra_params"), message.get("sampling_params")):
        if isinstance(block, dict) and any(key in block for key in FAULT_KEYS):
            return True
    return False


# --------------------------------------------------------------------------------------
# Talking to the server
# --------------------------------------------------------------------------------------


def connect(url: str) -> Any:
    return open_websocket_url(
        url, max_message_size=CLIENT_MAX_MESSAGE, connect_timeout=10, disconnect_timeout=5
    )


async def _send(ws: WebSocketConnection, wire: Wire) -> None:
    """Send, ignoring a closed connection: what the server said before is still read."""
    with contextlib.suppress(ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
        await ws.send_message(wire)


async def run_start(url: str, wire: Wire) -> StartTranscript:
    """One connection: send ``wire`` as the first message, read to the close. An accepted
    session is stopped after its first chunk (right away if it asked for a fault)."""
    transcript = StartTranscript(sent_bytes=wire_size(wire), fault_injected=fault_injected(wire))
    with trio.move_on_after(START_TIMEOUT) as scope:
        try:
            async with connect(url) as ws:
                await _send(ws, wire)
                await _read_start(ws, transcript)
        except DisconnectionTimeout:
            transcript.close_code = None  # judged as a connection that never closed
            transcript.timed_out = True
        except (HandshakeError, OSError) as exc:
            transcript.connect_error = f"{type(exc).__name__}: {exc}"
    transcript.timed_out = transcript.timed_out or scope.cancelled_caught
    return transcript


async def _read_start(ws: WebSocketConnection, transcript: StartTranscript) -> None:
    accepted = stop_sent = False
    stop_at = math.inf
    while True:
        with trio.move_on_at(stop_at) as wait:
            try:
                raw = await ws.get_message()
            except ConnectionClosed as exc:
                transcript.close_code = exc.reason.code
                return
        if wait.cancelled_caught:  # no first chunk yet: stop anyway
            stop_sent, stop_at = True, math.inf
            await _send(ws, protocol.STOP_MESSAGE)
            continue
        transcript.messages.append(raw)
        if not accepted and len(transcript.messages) == 1 and _is_video_start(raw):
            accepted = True
            if transcript.fault_injected:
                stop_sent = True
                await _send(ws, protocol.STOP_MESSAGE)
            else:
                stop_at = trio.current_time() + FIRST_CHUNK_WAIT
        elif accepted and not stop_sent and isinstance(raw, bytes):
            stop_sent, stop_at = True, math.inf
            await _send(ws, protocol.STOP_MESSAGE)


def _is_video_start(raw: Wire) -> bool:
    if isinstance(raw, bytes):
        return False
    try:
        message = json.loads(raw)
    except ValueError:
        return False
    return isinstance(message, dict) and message.get("type") == "video.start"


@attrs.define
class ControlSession:
    """One running session that control inputs are sent into."""

    ws: WebSocketConnection
    request_id: str | None = None
    alive: bool = True
    chunks: int = 0
    last_chunk_at: float = attrs.field(factory=trio.current_time)
    since_chunk: list[int] = attrs.field(factory=list)
    """Inputs sent since the last chunk: the suspects when the video stops moving."""
    pending: dict[str, int] = attrs.field(factory=dict)
    """Queued interactions not yet seen in a chunk's ``started_event_ids``: event id ->
    input index. When the session fails, these are the suspects."""

    @property
    def stuck(self) -> bool:
        return trio.current_time() - self.last_chunk_at > STUCK_AFTER


class HarnessError(Exception):
    """The run could not go on for a reason that is not the server's answer."""


class SessionRefused(Exception):
    """The server would not start the control session."""


async def open_session(ws: WebSocketConnection) -> ControlSession:
    session = ControlSession(ws)
    await _send(ws, CONTROL_START)
    with trio.move_on_after(REPLY_TIMEOUT):
        while True:
            try:
                raw = await ws.get_message()
            except ConnectionClosed as exc:
                raise SessionRefused(f"closed {exc.reason.code}") from None
            if isinstance(raw, bytes):
                continue
            message, _ = check_reply(raw)
            if message is not None and message["type"] == "video.start":
                session.request_id = message.get("request_id")
                return session
            raise SessionRefused(_shorten(raw))
    raise SessionRefused(f"no video.start in {REPLY_TIMEOUT:.0f} s")


async def _collect(
    session: ControlSession, exchange: Exchange, index: int, done: Callable[[], bool]
) -> None:
    """Read until ``done()``; after a terminal message, on to the close."""
    while exchange.terminal is not None or not done():
        try:
            raw = await session.ws.get_message()
        except ConnectionClosed as exc:
            exchange.close_code = exc.reason.code
            session.alive = False
            return
        if isinstance(raw, bytes):
            continue
        message, problems = check_reply(raw)
        exchange.problems += problems
        if message is None:
            exchange.messages.append(raw)
            continue
        if message["type"] == "video.chunk_metadata":
            session.chunks += 1
            session.last_chunk_at = trio.current_time()
            session.since_chunk.clear()
            for event_id in message.get("started_event_ids") or ():
                session.pending.pop(event_id, None)
            continue
        exchange.messages.append(raw)
        if exchange.terminal is not None:
            exchange.problems.append(Problem("message-after-terminal", message["type"]))
        elif is_terminal(message):
            exchange.terminal = message
            session.alive = False
        else:
            exchange.replies.append(message)
            if message["type"] == "session.interaction.queued":
                session.pending[str(message.get("event_id"))] = index


async def exchange(session: ControlSession, wire: Wire, index: int) -> Exchange:
    """Send ``wire`` then a ping; read the two answers (and any terminal message)."""
    result = Exchange(sent_bytes=wire_size(wire))
    with trio.move_on_after(REPLY_TIMEOUT) as scope:
        await _send(session.ws, wire)
        await _send(session.ws, protocol.PING_MESSAGE)
        await _collect(session, result, index, lambda: len(result.replies) >= 2)
    result.timed_out = scope.cancelled_caught
    return result


async def settle(session: ControlSession, index: int) -> Exchange:
    """Let `SETTLE_CHUNKS` chunks pass, so that what was queued has been applied."""
    result = Exchange(sent_bytes=0)
    target = session.chunks + SETTLE_CHUNKS
    with trio.move_on_after(REPLY_TIMEOUT) as scope:
        await _collect(session, result, index, lambda: session.chunks >= target)
    result.timed_out = scope.cancelled_caught
    return result


async def end_session(session: ControlSession, limit: int) -> tuple[str, list[Problem], Exchange]:
    """Stop a session that is still running; it must end with ``session.done``."""
    result = await exchange(session, protocol.STOP_MESSAGE, -1)
    outcome, problems = judge_control(result, limit)
    if outcome not in ("stopped", "completed") and not problems:
        problems.append(Problem("stop-not-done", outcome))
    return outcome, problems, result


async def http_get(
    endpoint: bench.Endpoint, path: str, timeout: float = 5.0
) -> tuple[int | None, bytes]:
    """A plain ``GET`` on the server's port; (None, why) when there is no answer."""
    with trio.move_on_after(timeout):
        try:
            stream = await endpoint.open_stream()
        except OSError as exc:
            return None, str(exc).encode()
        data = b""
        try:
            request = (
                f"GET {path} HTTP/1.1\r\nHost: {endpoint.host_header}\r\nConnection: close\r\n\r\n"
            )
            await stream.send_all(request.encode())
            while chunk := await stream.receive_some(65536):
                data += chunk
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await stream.aclose()
        head, _, body = data.partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0].split()
        return (int(status[1]) if len(status) > 1 and status[1].isdigit() else None), body
    return None, b"timed out"


# --------------------------------------------------------------------------------------
# Shrinking
# --------------------------------------------------------------------------------------


def parse_for_shrinking(wire: Wire) -> Any:
    """The JSON value in ``wire``, keeping what json.loads would lose as `Raw`; raises
    ValueError for what is not JSON (or has duplicate keys), which shrinks as text."""
    text = wire.decode("utf-8") if isinstance(wire, bytes) else wire

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        result = dict(items)
        if len(result) != len(items):
            raise ValueError("duplicate keys")
        return result

    def number(text: str) -> Any:
        value = float(text)
        return value if math.isfinite(value) else Raw(text)

    try:
        return json.loads(
            text,
            parse_constant=Raw,
            parse_float=number,
            parse_int=lambda digits: int(digits) if len(digits) < 4000 else Raw(digits),
            object_pairs_hook=pairs,
        )
    except RecursionError:
        raise ValueError("too deep") from None


def simpler(value: Any) -> Iterator[Any]:
    """Smaller variants of a JSON value, biggest cuts first."""
    if isinstance(value, dict):
        for key in value:
            yield {k: v for k, v in value.items() if k != key}
        for key, item in value.items():
            for smaller in simpler(item):
                yield {**value, key: smaller}
    elif isinstance(value, list):
        for index in range(len(value)):
            yield value[:index] + value[index + 1 :]
        for index, item in enumerate(value):
            for smaller in simpler(item):
                yield [*value[:index], smaller, *value[index + 1 :]]
    elif isinstance(value, str):
        if value:
            yield ""
        if value not in ("", "a"):
            yield "a"  # the plainest text that is still text
        if len(value) > 1:
            half = len(value) // 2
            yield value[:half]
            yield value[half:]
        if 1 < len(value) <= 64:
            for index in range(len(value)):
                yield value[:index] + value[index + 1 :]
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if value != 0:
            yield 0
        if abs(value) > 1:
            yield int(value / 2) if abs(value) < 2**53 else value // 2
    elif isinstance(value, float):
        if value != 0:
            yield 0.0
        if not value.is_integer():
            yield float(round(value))
    elif isinstance(value, Raw):
        yield 0


class _OutOfBudget(Exception):
    pass


async def shrink(
    wire: Wire, fails: Callable[[Wire], Awaitable[bool]], *, deadline: float, max_tries: int = 300
) -> tuple[Wire, int]:
    """The smallest variant of ``wire`` found that still ``fails``, and the tries spent.

    Greedy: JSON values lose keys, items and characters while the failure persists;
    what is not JSON loses chunks of text. Bounded by ``deadline`` (trio time) and
    ``max_tries``, since each try is a round trip to the server.
    """
    best = wire
    tries = 0

    async def attempt(candidate: Wire) -> bool:
        nonlocal best, tries
        if tries >= max_tries or trio.current_time() >= deadline:
            raise _OutOfBudget
        tries += 1
        failed = False
        with trio.move_on_at(deadline):
            failed = await fails(candidate)
        if failed and wire_size(candidate) <= wire_size(best):
            best = candidate
        return failed

    try:
        try:
            value = parse_for_shrinking(wire)
        except ValueError:
            value = None
        else:
            for ascii in (True, False):

                def encode(v: Any, ascii: bool = ascii) -> Wire:
                    text = to_json(v, ascii=ascii)
                    return text.encode("utf-8") if isinstance(wire, bytes) else text

                if await attempt(encode(value)):
                    improved = True
                    while improved:
                        improved = False
                        for candidate in simpler(value):
                            if await attempt(encode(candidate)):
                                value, improved = candidate, True
                                break
                    return best, tries
        await _shrink_text(best, attempt)
    except _OutOfBudget:
        pass
    return best, tries


async def _shrink_text(wire: Wire, attempt: Callable[[Wire], Awaitable[bool]]) -> None:
    """Delta debugging, lite: remove ever smaller chunks while the failure persists."""
    parts = 2
    while len(wire) >= 2:
        size = max(1, len(wire) // parts)
        for start in range(0, len(wire), size):
            candidate = wire[:start] + wire[start + size :]
            if candidate and await attempt(candidate):
                wire, parts = candidate, max(parts - 1, 2)
                break
        else:
            if size == 1:
                return
            parts = min(parts * 2, len(wire))


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


@attrs.define
class Violation:
    """One input (or server event) that broke the oracle."""

    phase: str
    """``start``, ``control`` or ``server``."""
    problem: Problem
    index: int | None = None
    input: FuzzInput | None = None
    messages: list[Wire] = attrs.field(factory=list)
    close_code: int | None = None
    request_id: str | None = None
    candidates: list[int] = attrs.field(factory=list)
    """Control inputs that may have caused a session failure (queued, not yet applied)."""
    cause: str | None = None
    """The exception the server logged for this session, if any: two bugs that both
    answer ``internal_error`` are two kinds of violation, each shrunk on its own."""

    @property
    def signature(self) -> str:
        cause = f"[{self.cause}]" if self.cause else ""
        return f"{self.phase}:{self.problem.key}{cause}"


@attrs.define
class Minimal:
    """A violation's smallest reproduction, replayed alone on the server."""

    input: FuzzInput | None
    tries: int
    messages: list[Wire]
    close_code: int | None
    request_id: str | None
    log: list[str]
    note: str = ""


@attrs.define
class Options:
    inputs: int
    seed: int
    time_limit: float
    shrink_time: float
    workers: int
    limits: protocol.Limits
    server_args: tuple[str, ...] = ()
    log_path: Path | None = None


@attrs.define
class Run:
    """The state of one fuzz run, shared by the phases."""

    options: Options
    server: bench.ServerProcess
    url: str
    endpoint: bench.Endpoint
    start_inputs: list[FuzzInput]
    control_inputs: list[FuzzInput]
    outcomes: dict[str, Counter[str]] = attrs.field(
        factory=lambda: {"start": Counter(), "control": Counter()}
    )
    kinds: Counter[str] = attrs.field(factory=Counter)
    done: Counter[str] = attrs.field(factory=Counter)
    violations: list[Violation] = attrs.field(factory=list)
    health_checks: int = 0
    control_sessions: int = 0
    retries: int = 0
    crashed: bool = False
    abort_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    progress_every: int = 1

    def record(self, phase: str, item: FuzzInput, outcome: str) -> None:
        self.outcomes[phase][outcome] += 1
        self.kinds[f"{item.kind}:{outcome.split(':')[0]}"] += 1

    def violate(self, violation: Violation) -> None:
        self.violations.append(violation)
        if sum(1 for v in self.violations if v.signature == violation.signature) == 1:
            progress(f"violation {violation.signature}: {violation.problem.detail}")

    async def after_input(self, phase: str) -> None:
        """Count an input; every `HEALTH_EVERY` of them, check the server is healthy."""
        self.done[phase] += 1
        total = sum(self.done.values())
        if total % self.progress_every == 0:
            progress(f"{total} inputs done ({dict(self.done)}), {len(self.violations)} violations")
        if self.done[phase] % HEALTH_EVERY == 0:
            await self.check_health()

    async def check_health(self) -> bool:
        self.health_checks += 1
        process = self.server.process
        if process is not None and process.poll() is not None:
            self.crash(f"server exited with status {process.returncode}")
            return False
        status, body = await http_get(self.endpoint, "/health")
        if status != 200 or body.strip() != b"ok":
            if process is not None and process.poll() is not None:
                self.crash(f"server exited with status {process.returncode}")
            else:
                self.violate(
                    Violation(
                        "server", Problem("health-failed", f"{status}: {_shorten(repr(body))}")
                    )
                )
            return False
        return True

    def crash(self, detail: str) -> None:
        if not self.crashed:
            self.crashed = True
            self.violate(Violation("server", Problem("server-crashed", detail)))
            self.abort_scope.cancel()


async def start_phase(run: Run) -> None:
    """Every start input on its own connection, a few at a time."""
    send, receive = trio.open_memory_channel[tuple[int, FuzzInput]](0)
    async with trio.open_nursery() as nursery:
        for _ in range(run.options.workers):
            nursery.start_soon(_start_worker, run, receive.clone())
        await receive.aclose()
        async with send:
            for index, item in enumerate(run.start_inputs):
                await send.send((index, item))


async def _start_worker(
    run: Run, receive: trio.MemoryReceiveChannel[tuple[int, FuzzInput]]
) -> None:
    limit = run.options.limits.max_start_bytes
    async with receive:
        async for index, item in receive:
            transcript = await run_start(run.url, item.wire)
            outcome, problems = judge_start(transcript, limit)
            run.record("start", item, outcome)
            for problem in problems:
                run.violate(
                    Violation(
                        "start",
                        problem,
                        index,
                        item,
                        transcript.messages,
                        transcript.close_code,
                        _request_id(transcript.messages),
                    )
                )
            if transcript.connect_error is not None:
                await run.check_health()
            await run.after_input("start")


async def control_phase(run: Run) -> None:
    """All control inputs in order, in as few sessions as the inputs allow."""
    inputs = run.control_inputs
    limit = run.options.limits.max_control_bytes
    index = 0
    retried: set[int] = set()
    while index < len(inputs):
        try:
            async with connect(run.url) as ws:
                session = await open_session(ws)
                run.control_sessions += 1
                while index < len(inputs) and session.alive:
                    item = inputs[index]
                    session.since_chunk.append(index)
                    result = await exchange(session, item.wire, index)
                    outcome, problems = judge_control(result, limit)
                    if outcome == "completed" and index not in retried:
                        retried.add(index)  # the video ran out: try again in a new one
                        run.retries += 1
                        break
                    run.record("control", item, outcome)
                    suspects = sorted({*session.pending.values(), index})
                    for problem in problems:
                        run.violate(
                            Violation(
                                "control",
                                problem,
                                index,
                                item,
                                result.messages,
                                result.close_code,
                                session.request_id,
                                suspects if not session.alive else [index],
                            )
                        )
                    index += 1
                    await run.after_input("control")
                    if session.alive and session.stuck:
                        run.violate(
                            Violation(
                                "control",
                                Problem("session-stuck", f"no chunk for {STUCK_AFTER:.0f} s"),
                                index - 1,
                                item,
                                result.messages,
                                None,
                                session.request_id,
                                sorted({*session.pending.values(), *session.since_chunk}),
                            )
                        )
                        break  # stop it and go on in a new session
                if session.alive:
                    outcome, problems, result = await end_session(session, limit)
                    for problem in problems:
                        run.violate(
                            Violation(
                                "control",
                                problem,
                                None,
                                FuzzInput("control.final-stop", protocol.STOP_MESSAGE),
                                result.messages,
                                result.close_code,
                                session.request_id,
                            )
                        )
        except (SessionRefused, HandshakeError, OSError) as exc:
            run.violate(
                Violation(
                    "server", Problem("control-session-refused", f"{type(exc).__name__}: {exc}")
                )
            )
            if not await run.check_health():
                return
            index += 1  # do not loop on the same input


def _request_id(messages: Sequence[Wire]) -> str | None:
    for raw in messages:
        if isinstance(raw, str):
            match = re.search(r'"request_id":"([^"]+)"', raw)
            if match:
                return match.group(1)
    return None


async def control_alone(
    url: str, wire: Wire, limit: int
) -> tuple[list[Problem], list[Wire], int | None, str | None]:
    """One control input alone in a fresh session, given time to take effect: its
    problems, the messages, the close code and the session's request id."""
    problems: list[Problem] = []
    messages: list[Wire] = []
    close_code: int | None = None
    request_id: str | None = None
    try:
        async with connect(url) as ws:
            session = await open_session(ws)
            request_id = session.request_id
            result = await exchange(session, wire, 0)
            _, found = judge_control(result, limit)
            problems += found
            messages += result.messages
            close_code = result.close_code
            if session.alive:
                later = await settle(session, 0)
                messages += later.messages
                close_code = later.close_code
                _, found = judge_control(later, limit, answers=0)
                problems += found
                if session.alive and session.stuck:
                    problems.append(Problem("session-stuck", f"no chunk for {STUCK_AFTER:.0f} s"))
            if session.alive:
                _, found, result = await end_session(session, limit)
                problems += found
                messages += result.messages
                close_code = result.close_code
    except (SessionRefused, HandshakeError, OSError) as exc:
        problems.append(Problem("control-session-refused", str(exc)))
    return problems, messages, close_code, request_id


async def shrink_phase(run: Run, deadline: float) -> dict[str, Minimal]:
    """Shrink the first violation of each kind to a small input that still shows it."""
    limits = run.options.limits
    minimal: dict[str, Minimal] = {}
    firsts: dict[str, Violation] = {}
    for violation in run.violations:
        firsts.setdefault(violation.signature, violation)
    for signature, violation in firsts.items():
        if violation.phase == "server" or violation.input is None or run.crashed:
            continue
        now = trio.current_time()
        left = len(firsts) - len(minimal)
        if now >= deadline - 1:
            break
        budget = now + max(1.0, (deadline - now) / max(1, left))
        key, cause = violation.problem.key, violation.cause

        def same_cause(offset: int, request_id: str | None, cause: str | None = cause) -> bool:
            if cause is None:
                return True
            return log_causes(_read_log(run.server, offset)).get(request_id or "") == cause

        if violation.phase == "start":

            async def fails(wire: Wire, key: str = key) -> bool:
                offset = _log_size(run.server)
                transcript = await run_start(run.url, wire)
                _, problems = judge_start(transcript, limits.max_start_bytes)
                return any(p.key == key for p in problems) and same_cause(
                    offset, _request_id(transcript.messages)
                )

            wire = violation.input.wire
            kind = violation.input.kind
            note = ""
        else:

            async def fails(wire: Wire, key: str = key) -> bool:
                offset = _log_size(run.server)
                problems, _, _, request_id = await control_alone(
                    run.url, wire, limits.max_control_bytes
                )
                return any(p.key == key for p in problems) and same_cause(offset, request_id)

            culprit = None
            # The input itself first, then the interactions queued before it, newest first.
            order = [
                violation.index,
                *sorted((c for c in violation.candidates if c != violation.index), reverse=True),
            ]
            for candidate in order:
                if candidate is None or trio.current_time() >= budget:
                    continue
                if await fails(run.control_inputs[candidate].wire):
                    culprit = candidate
                    break
            if culprit is None:
                minimal[signature] = Minimal(
                    None, 0, [], None, None, [], "not reproduced by any suspect alone"
                )
                continue
            wire = run.control_inputs[culprit].wire
            kind = run.control_inputs[culprit].kind
            note = f"caused by control input #{culprit} ({kind})"
        progress(f"shrinking {signature} ({wire_size(wire)} bytes)")
        small, tries = await shrink(wire, fails, deadline=budget)
        minimal[signature] = await _replay(
            run, violation.phase, FuzzInput(kind, small), tries, note
        )
    return minimal


async def _replay(run: Run, phase: str, item: FuzzInput, tries: int, note: str) -> Minimal:
    """Run the minimal input once more, for the report: its messages and the server log."""
    if phase == "start":
        transcript = await run_start(run.url, item.wire)
        messages, close_code = transcript.messages, transcript.close_code
        request_id = _request_id(messages)
    else:
        _, messages, close_code, request_id = await control_alone(
            run.url, item.wire, run.options.limits.max_control_bytes
        )
    log = log_excerpt(_read_log(run.server), request_id) if request_id else []
    return Minimal(item, tries, messages, close_code, request_id, log, note)


# --------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------

_LOG_RECORD: Final = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
_EXCEPTION_NAME: Final = re.compile(
    r"[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Closed|Timeout|Warning)\b"
)


FAILURE_KEYS: Final = frozenset(
    {
        "internal-error",
        "closed-without-message",
        "closed-without-terminal",
        "abnormal-close",
        "no-terminal",
        "no-reply",
        "session-stuck",
    }
)


def is_failure(key: str) -> bool:
    """Whether a problem is the server failing (then the exception it logged tells two
    such bugs apart) rather than a wrong answer (where a logged exception is unrelated)."""
    return key in FAILURE_KEYS or key.startswith(("session-ended-", "accepted-then-"))


def _read_log(server: bench.ServerProcess, offset: int = 0) -> str:
    """The server's log from byte ``offset`` on."""
    try:
        with server.log_path.open("rb") as log:
            log.seek(offset)
            return log.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _log_size(server: bench.ServerProcess) -> int:
    try:
        return server.log_path.stat().st_size
    except OSError:
        return 0


_SESSION_ID: Final = re.compile(r"session (video_stream-[0-9a-f]+)")


def log_causes(text: str) -> dict[str, str]:
    """Request id -> the name of the exception logged with it (the last one, for chains)."""
    causes: dict[str, str] = {}
    current: str | None = None
    for line in text.splitlines():
        if _LOG_RECORD.match(line):
            match = _SESSION_ID.search(line)
            current = match.group(1) if match else None
            continue
        stripped = line.lstrip(" |+")
        if current is not None and _EXCEPTION_NAME.match(stripped):
            name = stripped.split(":", 1)[0]
            if name not in ("ExceptionGroup", "BaseExceptionGroup"):
                causes[current] = name
    return causes


_EXCEPTION_LINE: Final = re.compile(r"[\s|+]*\w[\w.]*(Error|Exception|Group)\b")
_TRACEBACK_NOISE: Final = ("Traceback", "During handling", "The above exception", "File ", "^")


def log_excerpt(text: str, needle: str, limit: int = 30) -> list[str]:
    """The log records that mention ``needle``; of their tracebacks, the project's own
    frames and the exception: what tells where a failure came from."""
    lines: list[str] = []
    keep = False
    in_frame = False
    for line in text.splitlines():
        if _LOG_RECORD.match(line):
            keep = needle in line
            if keep:
                lines.append(_shorten(line, 300))
            continue
        stripped = line.lstrip(" |+")
        if not keep or not stripped:
            continue
        if stripped.startswith("File "):
            in_frame = "trio_vstream" in stripped
            if in_frame:
                lines.append(f"  {_shorten(stripped, 300)}")
        elif in_frame and not stripped.startswith("^"):
            lines.append(f"      {_shorten(stripped, 300)}")  # the frame's source line
            in_frame = False
        elif (
            _EXCEPTION_LINE.match(line)
            and not stripped.startswith(_TRACEBACK_NOISE)
            and not stripped.startswith(("ExceptionGroup", "BaseExceptionGroup"))
        ):
            lines.append(f"  {_shorten(stripped, 300)}")
    return lines[:limit]


def log_exceptions(text: str) -> Counter[str]:
    """The exceptions in the log's tracebacks (groups' members, not the groups), counted:
    what the server logged as a failure, whether or not a client saw one."""
    found: Counter[str] = Counter()
    seen: set[str] = set()
    inside = False
    for line in text.splitlines():
        if _LOG_RECORD.match(line):
            inside, seen = False, set()
            continue
        stripped = line.lstrip(" |+")
        if "Traceback (most recent call last)" in stripped:
            inside = True
        elif (
            inside
            and _EXCEPTION_NAME.match(stripped)
            and not stripped.startswith(("ExceptionGroup", "BaseExceptionGroup"))
            and stripped not in seen
        ):
            seen.add(stripped)
            found[_shorten(stripped, 200)] += 1
    return found


def describe_wire(wire: Wire, limit: int = 600) -> dict[str, Any]:
    """A message for the JSON report (bounded: an oversize input is megabytes)."""
    if isinstance(wire, bytes):
        shown = wire[:limit]
        return {
            "frame": "binary",
            "bytes": len(wire),
            "hex": shown.hex(),
            "truncated": len(wire) > limit,
        }
    return {
        "frame": "text",
        "bytes": wire_size(wire),
        "text": wire[:limit],
        "truncated": len(wire) > limit,
    }


def describe_messages(messages: Sequence[Wire], limit: int = 12) -> list[Any]:
    shown: list[Any] = []
    for raw in messages[:limit]:
        if isinstance(raw, bytes):
            shown.append(f"<binary {len(raw)} bytes>")
        else:
            shown.append(_shorten(raw, 600))
    if len(messages) > limit:
        shown.append(f"... {len(messages) - limit} more")
    return shown


def build_report(
    run: Run,
    minimal: dict[str, Minimal],
    timings: dict[str, float],
    complete: bool,
    exit_status: int | None,
) -> dict[str, Any]:
    groups: dict[str, list[Violation]] = {}
    for violation in run.violations:
        groups.setdefault(violation.signature, []).append(violation)
    violations = []
    for signature, group in groups.items():
        first = group[0]
        entry: dict[str, Any] = {
            "signature": signature,
            "count": len(group),
            "detail": first.problem.detail,
            "first": {
                "index": first.index,
                "input": describe_wire(first.input.wire) if first.input else None,
                "kind": first.input.kind if first.input else None,
                "replies": describe_messages(first.messages),
                "close_code": first.close_code,
                "request_id": first.request_id,
                "suspects": first.candidates,
            },
        }
        found = minimal.get(signature)
        if found is not None:
            entry["minimal"] = {
                "input": describe_wire(found.input.wire) if found.input else None,
                "tries": found.tries,
                "replies": describe_messages(found.messages),
                "close_code": found.close_code,
                "request_id": found.request_id,
                "server_log": found.log,
                "note": found.note,
            }
        violations.append(entry)
    accepted = {
        "start": run.outcomes["start"]["accepted"],
        "control": sum(run.outcomes["control"][k] for k in ("pong", "queued", "stopped")),
    }
    errors: Counter[str] = Counter()
    for counter in run.outcomes.values():
        for outcome, count in counter.items():
            if outcome.startswith("error:"):
                errors[outcome.removeprefix("error:")] += count
    return {
        "seed": run.options.seed,
        "inputs_requested": run.options.inputs,
        "inputs_run": sum(run.done.values()),
        "complete": complete,
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "limits": attrs.asdict(run.options.limits),
        "server": {
            "command": run.server.command,
            "log": str(run.server.log_path),
            "exit_status": exit_status,
            "logged_exceptions": dict(log_exceptions(_read_log(run.server)).most_common(20)),
        },
        "accepted": accepted,
        "errors": dict(errors.most_common()),
        "outcomes": {phase: dict(counter.most_common()) for phase, counter in run.outcomes.items()},
        "kinds": dict(sorted(run.kinds.items())),
        "control_sessions": run.control_sessions,
        "control_retries": run.retries,
        "health_checks": run.health_checks,
        "violation_count": len(run.violations),
        "violations": violations,
    }


def _wire_text(described: dict[str, Any]) -> str:
    if described["frame"] == "binary":
        return f"<binary {described['bytes']} bytes> {described['hex']}"
    return described["text"]


def print_summary(report: dict[str, Any]) -> None:
    out = sys.stdout
    start, control = report["outcomes"]["start"], report["outcomes"]["control"]
    print(
        f"fuzz: seed {report['seed']}: {report['inputs_run']} of "
        f"{report['inputs_requested']} inputs "
        f"({sum(start.values())} session.start, {sum(control.values())} control) in "
        f"{report['timings_s']['total']:.1f} s"
        + ("" if report["complete"] else "  ** INCOMPLETE **"),
        file=out,
    )
    accepted = report["accepted"]
    print(
        f"  accepted: {accepted['start'] + accepted['control']} "
        f"(start: {accepted['start']} video.start; "
        f"control: {control.get('pong', 0)} pong, {control.get('queued', 0)} queued, "
        f"{control.get('stopped', 0)} stopped)",
        file=out,
    )
    errors = ", ".join(f"{code} {count}" for code, count in report["errors"].items()) or "none"
    print(f"  coded errors: {errors}", file=out)
    other = {k: v for phase in (start, control) for k, v in phase.items() if k == "closed-1009"}
    if other:
        print(
            f"  closed 1009 (over twice the size limit, documented): {other['closed-1009']}",
            file=out,
        )
    logged = report["server"]["logged_exceptions"]
    if logged:
        print(f"  server logged {sum(logged.values())} tracebacks:", file=out)
        for line, count in list(logged.items())[:8]:
            print(f"    {count:5d} x {line}", file=out)
    print(
        f"  health checks: {report['health_checks']}; "
        f"control sessions: {report['control_sessions']}",
        file=out,
    )
    if not report["violations"]:
        print("  violations: none", file=out)
        return
    print(
        f"  VIOLATIONS: {report['violation_count']} ({len(report['violations'])} kinds)", file=out
    )
    for entry in report["violations"]:
        print(f"  - {entry['signature']} x{entry['count']}: {entry['detail']}", file=out)
        first = entry["first"]
        if first["input"] is not None:
            shown = _shorten(ascii(_wire_text(first["input"])), 240)
            print(f"      first: {first['kind']} #{first['index']}: {shown}", file=out)
        found = entry.get("minimal")
        if found is None:
            continue
        if found["note"]:
            print(f"      {found['note']}", file=out)
        if found["input"] is not None:
            shown = found["input"].get("text", found["input"].get("hex"))
            print(
                f"      minimal ({found['tries']} tries): {_shorten(ascii(shown), 400)}", file=out
            )
            for reply in found["replies"][:4]:
                print(f"        <- {_shorten(ascii(reply), 300)}", file=out)
            print(f"        close {found['close_code']}", file=out)
            log = found["server_log"]
            for line in log if len(log) <= 14 else [*log[:1], "...", *log[-12:]]:
                print(f"        log| {line}", file=out)


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def server_command(limits: protocol.Limits, extra: Sequence[str]) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "trio_vstream",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--engine",
        "synthetic",
        "--max-sessions",
        "32",
        "--max-start-bytes",
        str(limits.max_start_bytes),
        "--max-control-bytes",
        str(limits.max_control_bytes),
    ]
    for key, value in ENGINE_ARGS:
        command += ["--engine-arg", f"{key}={value}"]
    return command + list(extra)


async def fuzz(options: Options) -> tuple[dict[str, Any], int]:
    """Generate, send, check, shrink; the report and the exit status."""
    began = trio.current_time()
    deadline = began + options.time_limit
    timings: dict[str, float] = {}
    n_start = options.inputs // 2
    start_items = draw_inputs(start_inputs(options.limits), n_start, options.seed)
    control_items = draw_inputs(
        control_inputs(options.limits), options.inputs - n_start, options.seed + 1
    )
    timings["generate"] = trio.current_time() - began
    progress(
        f"generated {len(start_items)} start and {len(control_items)} control inputs "
        f"in {timings['generate']:.1f} s"
    )

    log_path = (
        options.log_path or Path(tempfile.mkdtemp(prefix="trio-vstream-fuzz-")) / "server.log"
    )
    server = bench.ServerProcess(server_command(options.limits, options.server_args), log_path)
    try:
        url = await server.start(timeout=60)
    except RuntimeError as exc:
        await server.stop(grace=5)
        raise HarnessError(f"the server did not start: {exc}") from None
    run = Run(options, server, url, bench.Endpoint.parse(url), start_items, control_items)
    run.progress_every = max(100, options.inputs // 10)
    complete = False
    exit_status: int | None = None
    minimal: dict[str, Minimal] = {}
    try:
        reserve = min(options.shrink_time, options.time_limit / 4) + 10
        fuzz_began = trio.current_time()
        with run.abort_scope, trio.move_on_at(deadline - reserve) as limit:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(start_phase, run)
                nursery.start_soon(control_phase, run)
        timings["send"] = trio.current_time() - fuzz_began
        complete = not limit.cancelled_caught and not run.crashed
        if limit.cancelled_caught:
            progress("time limit reached: the run is incomplete")
        if not run.crashed and await run.check_health():
            await _check_released(run)
        causes = log_causes(_read_log(server))
        for violation in run.violations:
            if is_failure(violation.problem.key):
                violation.cause = causes.get(violation.request_id or "")
        shrink_began = trio.current_time()
        if run.violations and not run.crashed:
            minimal = await shrink_phase(
                run, min(deadline - 10, shrink_began + options.shrink_time)
            )
        timings["shrink"] = trio.current_time() - shrink_began
    finally:
        exit_status = await server.stop(grace=5)
    if exit_status != 0 and not run.crashed:
        run.violate(Violation("server", Problem("server-exit-status", f"SIGTERM -> {exit_status}")))
    timings["total"] = trio.current_time() - began
    report = build_report(run, minimal, timings, complete, exit_status)
    status = 1 if run.violations else (0 if complete else 3)
    return report, status


async def _check_released(run: Run, timeout: float = 10.0) -> None:
    """After the run: no session, engine stream or worker thread may be left."""
    keys = ("sessions_active", "streams_open", "worker_threads")
    metrics: dict[str, Any] | None = None
    with trio.move_on_after(timeout):
        while True:
            metrics = await bench.fetch_stats(run.endpoint)
            if metrics is None or all(metrics.get(key, 0) == 0 for key in keys):
                return
            await trio.sleep(0.05)
    left = {key: metrics.get(key) for key in keys} if metrics else {}
    run.violate(
        Violation(
            "server", Problem("resources-not-released", f"{timeout:.0f} s after the run: {left}")
        )
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python bench/fuzz.py",
        description="Hypothesis fuzz of session.start and control messages against a real "
        "trio_vstream server (exit status: 0 clean, 1 violations, 3 incomplete).",
    )
    parser.add_argument(
        "--inputs",
        type=int,
        default=2000,
        help="inputs in all, half of them session.start (default %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Hypothesis seed: the same seed, the same inputs (default %(default)s)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the report here as JSON")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=900.0,
        help="seconds for the whole run, shrinking included (default %(default)s)",
    )
    parser.add_argument(
        "--shrink-time",
        type=float,
        default=60.0,
        help="seconds for shrinking the violations found (default %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=4,
        help="concurrent session.start connections (default %(default)s)",
    )
    parser.add_argument(
        "--max-start-bytes",
        type=int,
        default=protocol.DEFAULT_LIMITS.max_start_bytes,
        help="the server's limit, passed to it and aimed at (default %(default)s)",
    )
    parser.add_argument(
        "--max-control-bytes",
        type=int,
        default=protocol.DEFAULT_LIMITS.max_control_bytes,
        help="the server's limit, passed to it and aimed at (default %(default)s)",
    )
    parser.add_argument(
        "--server-log",
        type=Path,
        default=None,
        help="where the server's log goes (default: a temporary directory)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the server command line (repeatable)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.inputs < 2 or args.workers < 1 or args.time_limit <= 0:
        build_parser().error("--inputs must be >= 2, --workers >= 1, --time-limit > 0")
    limits = attrs.evolve(
        protocol.DEFAULT_LIMITS,
        max_start_bytes=args.max_start_bytes,
        max_control_bytes=args.max_control_bytes,
    )
    options = Options(
        inputs=args.inputs,
        seed=args.seed,
        time_limit=args.time_limit,
        shrink_time=args.shrink_time,
        workers=args.workers,
        limits=limits,
        server_args=tuple(args.server_arg),
        log_path=args.server_log,
    )
    began = time.monotonic()
    try:
        report, status = trio.run(fuzz, options)
    except HarnessError as exc:
        print(f"fuzz: {exc}", file=sys.stderr)
        return 3
    report["timings_s"]["wall"] = round(time.monotonic() - began, 2)
    print_summary(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())

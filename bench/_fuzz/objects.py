"""The fuzz's message objects: ``session.start``, ``session.interaction`` and the other
control messages, as JSON objects before they are written out.

Mostly near-valid: the protocol's real field names, each with a table of valid-ish
values (mostly accepted, often just not), image references and codec options that reach
the decoders and the encoder, and some of everything else (``values.JSON_ANY`` in any
field, typo'd keys, wrong types). An input that fails the first check tests only that
check.
"""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any, Final

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from bench._fuzz.settings import (
    FAULT_KEYS,
    SERVED_MODEL,
)
from bench._fuzz.values import (
    FLOATS,
    INTS,
    JSON_ANY,
    JSON_KEYS,
    NAMES,
    SPECIAL_NUMBERS,
    START_FIELDS,
    TEXT_SHORT,
    deep_values,
    long_texts,
    weighted,
)
from bench._fuzz.wire import ABSENT
from trio_vstream import protocol


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


BAD_FRAME_FORMATS: Final = ("JPEG", "jpg", "gif", "image/jpeg", "", "png ", "avif")
"""``input_video.frame_format`` values that are not one of the three."""


def input_video_objects(
    dimension: SearchStrategy[Any], flag: SearchStrategy[Any]
) -> SearchStrategy[dict[str, Any]]:
    """``session.start``'s ``input_video``: its fields valid-ish (``v2v_strength``, the
    alias of ``strength``, sometimes beside it), or anything."""
    strength = weighted(
        (4, st.floats(0, 1)),
        (1, st.sampled_from([-0.0, 1, 0, -1e-9, 1.0000001, 2, "0.5", None, True])),
        (1, SPECIAL_NUMBERS),
    )
    fields = st.fixed_dictionaries(
        {},
        optional={
            "frame_format": weighted(
                (6, st.sampled_from(protocol.INPUT_FRAME_FORMATS)),
                (1, st.sampled_from(BAD_FRAME_FORMATS)),
                (1, JSON_ANY),
            ),
            "fps": weighted(
                (6, st.integers(1, protocol.MAX_INPUT_FPS)),
                (1, st.sampled_from([0, -1, 61, 2**31, 24.0, "24", True])),
            ),
            "width": dimension,
            "height": dimension,
            "strength": strength,
            "v2v_strength": strength,
            "on_end": weighted(
                (4, st.sampled_from(["hold", "end"])),
                (1, st.sampled_from(["HOLD", "stop", "", None, 1])),
            ),
            "max_wait_ms": weighted(
                (4, st.integers(0, 300)),
                (1, st.sampled_from([5000, 5001, -1, 250.0, "250", 2**63])),  # 5000: the most
            ),
            "strict": flag,
        },
    )
    extra = st.dictionaries(JSON_KEYS, JSON_ANY, min_size=1, max_size=2)
    return weighted(
        (8, fields),
        (1, st.builds(lambda a, b: {**a, **b}, fields, extra)),
        (1, st.dictionaries(JSON_KEYS, JSON_ANY, max_size=3)),
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
        "input_video": input_video_objects(dimension, flag),
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


def with_junk(message: dict[str, Any]) -> SearchStrategy[dict[str, Any]]:
    """``message`` as it is, or with a few keys of anything added."""
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

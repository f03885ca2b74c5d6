"""``extra_params.video_codec_options``: the libx264 options a client may choose, and no others.

libx264 options reach further than picture quality. Through ``x264-params`` (or
``x264opts``) a client could name ``dump-yuv=/any/path``, and the server would write its
raw frames to that path; ``cqmfile=`` tells whether a file exists; ``preset=placebo`` or
``veryslow`` costs orders of magnitude more CPU per frame; ``bframes``, ``rc-lookahead``,
``intra-refresh`` or ``forced-idr=0`` defeat the zero-delay, keyframe-per-chunk stream the
server promises (see ``trio_vstream.media.h264``). So the options are an allow-list, each
value checked, and everything else is refused by name.

This module is the one definition of that list. `parse_start` applies it (a client hears
``invalid_request`` before any encoder opens) and ``FragmentedMP4Encoder`` applies it
again to whatever it is handed, so a caller that skips the protocol cannot get around
it. It is pure (no Trio, no PyAV), like the rest of the protocol package.

The options:

* ``crf``: constant rate factor, a number in 0..51 (x264's 8-bit range).
* ``qp``: constant quantiser, an integer in 0..51 (0 is lossless).
* ``preset``: ``ultrafast`` .. ``medium``. The slower presets are refused: one
  ``veryslow`` session at 1080p takes a CPU core's worth of seconds per frame.
* ``tune``: one of x264's tunings.
* ``profile``: ``baseline``, ``main`` or ``high``: the profiles of 8-bit 4:2:0, which is
  what the encoder is always fed.
* ``g``: the longest distance between keyframes, in frames, 1..600. It can only add
  keyframes: the IDR the encoder forces at the start of every chunk (what a viewer
  joins at) comes regardless.
* ``x264-params`` / ``x264opts``: ``key=value:key=value`` text handed to x264 itself. Only
  ``crf``, ``qp`` and ``keyint`` (x264's name for ``g``) are accepted there, with the same
  checks. (x264 ignores ``preset``, ``tune`` and ``profile`` there, with only a warning in
  the server's log, so they are refused rather than silently dropped.)

Values may be JSON numbers or strings (``"qp": "0"``). The checked options come back as
the strings libx264 takes, in one canonical form (``23.5``, ``crf=20:keyint=48``), so
checking them twice gives the same answer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Final

from trio_vstream.protocol._wire import show

__all__ = [
    "CODEC_OPTIONS_PARAM",
    "CODEC_OPTION_NAMES",
    "MAX_KEYFRAME_INTERVAL",
    "PRESETS",
    "PROFILES",
    "TUNES",
    "X264_PARAMS_NAMES",
    "CodecOptionError",
    "check_codec_options",
]

CODEC_OPTIONS_PARAM: Final = "video_codec_options"
"""The ``extra_params`` key (the server applies it; it never reaches an engine)."""

PRESETS: Final = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium")
"""x264's presets up to its default: the slower ones are a CPU denial of service."""
TUNES: Final = (
    "film",
    "animation",
    "grain",
    "stillimage",
    "fastdecode",
    "zerolatency",
    "psnr",
    "ssim",
)
PROFILES: Final = ("baseline", "main", "high")
"""The H.264 profiles of 8-bit 4:2:0 (the encoder's only input)."""
MAX_QUANTISER: Final = 51
MAX_KEYFRAME_INTERVAL: Final = 600
"""Frames: 25 s at 24 fps. A longer GOP saves nothing more (every chunk starts one anyway)."""
MAX_X264_PARAMS_CHARS: Final = 200

_NUMBER: Final = re.compile(r"[0-9]{1,3}(?:\.[0-9]{1,6})?")
_INTEGER: Final = re.compile(r"[0-9]{1,4}")


class CodecOptionError(ValueError):
    """A codec option that is not allowed, or a value out of its range; says which."""


_PLAIN_NAME: Final = re.compile(r"[A-Za-z0-9_.-]{1,40}")


def _name(name: object) -> str:
    """An option name a client sent, for a message: as is when plain, else quoted."""
    return name if isinstance(name, str) and _PLAIN_NAME.fullmatch(name) else show(name)


def _number(value: object, integer: bool, low: int, high: int, what: str) -> str:
    """``value`` (a JSON number, or a decimal string) checked against ``low..high``, in
    canonical text; raises `CodecOptionError` naming ``what`` it must be."""
    wanted = f"must be {what} in {low}..{high}, got {show(value)}"
    if isinstance(value, str):
        if not (_INTEGER if integer else _NUMBER).fullmatch(value):
            raise CodecOptionError(wanted)
        number = float(value)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
        if not math.isfinite(number) or (integer and not number.is_integer()):
            raise CodecOptionError(wanted)
    else:
        raise CodecOptionError(wanted)
    if not low <= number <= high:
        raise CodecOptionError(wanted)
    if integer:
        return str(int(number))
    return f"{number:.6f}".rstrip("0").rstrip(".")


def _one_of(choices: tuple[str, ...], why: str = "") -> Callable[[object], str]:
    def check(value: object) -> str:
        if isinstance(value, str) and value in choices:
            return value
        raise CodecOptionError(f"{show(value)} is not allowed{why}; allowed: {', '.join(choices)}")

    return check


def _crf(value: object) -> str:
    return _number(value, False, 0, MAX_QUANTISER, "a number")


def _qp(value: object) -> str:
    return _number(value, True, 0, MAX_QUANTISER, "an integer")


def _keyframe_interval(value: object) -> str:
    return _number(value, True, 1, MAX_KEYFRAME_INTERVAL, "a whole number of frames")


_X264_PARAMS: Final[dict[str, Callable[[object], str]]] = {
    "crf": _crf,
    "qp": _qp,
    "keyint": _keyframe_interval,
}
"""What ``x264-params`` may hold: x264's own names for the options above."""

X264_PARAMS_NAMES: Final = ("x264-params", "x264opts")


def _x264_params(value: object) -> str:
    """``key=value:key=value``, each key allowed and each value checked.

    FFmpeg splits this text with ``av_dict_parse_string``, which also honours quotes and
    backslash escapes. The characters the checked values are made of include none of
    those, so the split here is the split libx264 sees.
    """
    if not isinstance(value, str):
        raise CodecOptionError(f"must be a string of key=value:key=value, got {show(value)}")
    if len(value) > MAX_X264_PARAMS_CHARS:
        raise CodecOptionError(f"is longer than {MAX_X264_PARAMS_CHARS} characters")
    allowed = ", ".join(_X264_PARAMS)
    canonical: dict[str, str] = {}
    for item in value.split(":"):
        key, equals, text = item.partition("=")
        if key not in _X264_PARAMS:
            shown = _name(key) if key else "an empty entry"
            raise CodecOptionError(f"{shown} is not allowed; allowed: {allowed}")
        if not equals:
            raise CodecOptionError(f"{key} needs a value ({key}=...)")
        if key in canonical:
            raise CodecOptionError(f"{key} is given twice")
        try:
            canonical[key] = _X264_PARAMS[key](text)
        except CodecOptionError as exc:
            raise CodecOptionError(f"{key} {exc}") from None
    return ":".join(f"{key}={text}" for key, text in canonical.items())


_OPTIONS: Final[dict[str, Callable[[object], str]]] = {
    "crf": _crf,
    "qp": _qp,
    "preset": _one_of(PRESETS, " (slower presets cost too much CPU)"),
    "tune": _one_of(TUNES),
    "profile": _one_of(PROFILES),
    "g": _keyframe_interval,
    "x264-params": _x264_params,
    "x264opts": _x264_params,
}

CODEC_OPTION_NAMES: Final = tuple(_OPTIONS)
"""Every option name a client may give, in the order error messages list them."""


def check_codec_options(
    options: object, where: str = f"extra_params.{CODEC_OPTIONS_PARAM}"
) -> dict[str, str]:
    """The options as libx264 takes them, every name allowed and every value checked.

    Raises `CodecOptionError` for the first problem, its message starting with ``where``
    and naming the option (``extra_params.video_codec_options.x264-params: dump-yuv is
    not allowed; allowed: crf, qp, keyint``).
    """
    if not isinstance(options, Mapping):
        raise CodecOptionError(f"{where} must be an object, got {show(options)}")
    checked: dict[str, str] = {}
    for name, value in options.items():
        check = _OPTIONS.get(name) if isinstance(name, str) else None
        if check is None:
            raise CodecOptionError(
                f"{where}: option {_name(name)} is not allowed; "
                f"allowed: {', '.join(CODEC_OPTION_NAMES)}"
            )
        try:
            checked[name] = check(value)
        except CodecOptionError as exc:
            raise CodecOptionError(f"{where}.{name}: {exc}") from None
    return checked

"""Strict JSON in and out: the shared cattrs converters, their hooks, and JSON loading.

cattrs coerces by default (``"30"`` becomes ``30``, a string is iterated into a tuple);
the hooks here refuse that, so that a client bug is reported instead of guessed at.
Both directions of the wire use these helpers: `_start` (``session.start``),
`_control` (control messages) and `_messages` (server messages, every message's text).
"""

import difflib
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError
from cattrs.gen import make_dict_structure_fn, override

from trio_vstream.protocol._errors import ErrorCode, ProtocolError

CHECKS: Final = "trio_vstream.checks"


@attrs.frozen
class Checks:
    """Constraints on one request field, checked while structuring.

    Checking inside the structure hook (rather than after) lets range errors be reported
    together with type errors in other fields, in one message.
    """

    ge: int | float | None = None
    gt: int | float | None = None
    le: int | float | None = None
    pattern: str | None = None
    pattern_hint: str = ""
    nonblank: bool = False

    def problem(self, value: Any) -> str | None:
        if self.nonblank and isinstance(value, str) and not value.strip():
            return "must be a non-empty string"
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            return f"must be {self.pattern_hint}, got {show(value)}"
        if self.ge is not None and self.le is not None and not self.ge <= value <= self.le:
            return f"must be between {self.ge} and {self.le}, got {show(value)}"
        if self.ge is not None and self.le is None and value < self.ge:
            return f"must be >= {self.ge}, got {show(value)}"
        if self.gt is not None and self.le is not None and not self.gt < value <= self.le:
            return f"must be > {self.gt} and <= {self.le}, got {show(value)}"
        if self.gt is not None and not value > self.gt:
            return f"must be > {self.gt}, got {show(value)}"
        return None


def field_with_checks(default: Any = None, **checks: Any) -> Any:
    return attrs.field(default=default, metadata={CHECKS: Checks(**checks)})


# --------------------------------------------------------------------------------------
# Strict structuring
# --------------------------------------------------------------------------------------


class Invalid(ValueError):
    """A value failed a check; the text reads after the field path ("width <text>")."""


def show(value: Any, limit: int = 40) -> str:
    """Render a client value for an error message, in JSON terms and bounded in size."""
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, str) and len(value) > limit:
        value = value[:limit]
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


def quote(name: str, limit: int = 40) -> str:
    return f"'{name}'" if len(name) <= limit else f"'{name[: limit - 3]}...'"


def _structure_int(value: Any, _: Any) -> int:
    # bool is an int subclass, and cattrs would happily truncate floats or parse strings.
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(f"must be an integer, got {show(value)}")
    return value


def _structure_float(value: Any, _: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Invalid(f"must be a number, got {show(value)}")
    try:
        result = float(value)
    except OverflowError:  # an integer too large for a double
        result = math.inf
    if not math.isfinite(result):
        raise Invalid(f"must be a finite number, got {show(value)}")
    return result


def _structure_str(value: Any, _: Any) -> str:
    if not isinstance(value, str):
        raise Invalid(f"must be a string, got {show(value)}")
    return value


def _structure_bool(value: Any, _: Any) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"must be true or false, got {show(value)}")
    return value


def _structure_object(value: Any, _: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Invalid(f"must be an object, got {show(value)}")
    return value


def _is_literal(tp: Any) -> bool:
    return get_origin(tp) is Literal


def _structure_literal(value: Any, tp: Any) -> Any:
    choices = get_args(tp)
    # `in` alone would let True match 1; compare types too.
    if not any(type(value) is type(choice) and value == choice for choice in choices):
        allowed = ", ".join(show(choice) for choice in choices)
        raise Invalid(f"must be one of {allowed}, got {show(value)}")
    return value


def _is_object_type(tp: Any) -> bool:
    return tp is dict or get_origin(tp) is dict


def _is_str_tuple(tp: Any) -> bool:
    return tp == tuple[str, ...]


def _structure_str_tuple(value: Any, _: Any) -> tuple[str, ...]:
    # cattrs would iterate a string into its characters.
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise Invalid(f"must be an array of strings, got {show(value)}")
    return tuple(value)


def _checked(base: Callable[[Any, Any], Any], checks: Checks) -> Callable[[Any, Any], Any]:
    def hook(value: Any, tp: Any) -> Any:
        result = base(value, tp)
        if result is not None:
            problem = checks.problem(result)
            if problem is not None:
                raise Invalid(problem)
        return result

    return hook


def _make_attrs_hook(
    converter: cattrs.Converter, forbid_extra_keys: bool
) -> Callable[[type], Callable[[Any, Any], Any]]:
    def factory(cls: type) -> Callable[[Any, Any], Any]:
        attrs.resolve_types(cls)
        # Values Any, not cattrs' AttributeOverride: mypy matches a **dict's values
        # against every keyword parameter, the _cattrs_ options too, while these keys
        # are field names, which only reach **kwargs.
        overrides: dict[str, Any] = {}
        for field in attrs.fields(cls):
            checks = field.metadata.get(CHECKS)
            if checks is not None:
                base = converter.get_structure_hook(field.type)
                overrides[field.name] = override(struct_hook=_checked(base, checks))
        inner: Callable[[Mapping[str, Any], Any], Any] = make_dict_structure_fn(
            cls, converter, _cattrs_forbid_extra_keys=forbid_extra_keys, **overrides
        )

        def hook(value: Any, tp: Any) -> Any:
            # Without this, a string would be taken apart into "unknown keys".
            if not isinstance(value, dict):
                raise Invalid(f"must be an object, got {show(value)}")
            return inner(value, tp)

        return hook

    return factory


def _make_converter(*, forbid_extra_keys: bool) -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=forbid_extra_keys, detailed_validation=True)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook_func(_is_object_type, _structure_object)
    converter.register_structure_hook_func(_is_literal, _structure_literal)
    converter.register_structure_hook_func(_is_str_tuple, _structure_str_tuple)
    converter.register_structure_hook_factory(
        attrs.has, _make_attrs_hook(converter, forbid_extra_keys)
    )
    return converter


REQUEST_CONVERTER: Final = _make_converter(forbid_extra_keys=True)
LENIENT_CONVERTER: Final = _make_converter(forbid_extra_keys=False)


def _describe(exc: BaseException, _type: Any) -> str:
    if isinstance(exc, KeyError):
        return "is required"
    if isinstance(exc, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        items = []
        for key in sorted(exc.extra_fields):
            hint = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
            items.append(quote(key) + (f" (did you mean {quote(hint[0])}?)" if hint else ""))
        noun = "unknown field" if len(items) == 1 else "unknown fields"
        return f"{noun} {', '.join(items)}"
    if isinstance(exc, Invalid):
        return str(exc)
    return f"is invalid ({exc})"


def validation_problems(exc: BaseException) -> list[str]:
    """Turn a cattrs error tree into "path description" sentences."""
    problems = []
    for line in cattrs.transform_error(exc, path="$", format_exception=_describe):
        description, _, path = line.rpartition(" @ ")
        path = path.removeprefix("$").removeprefix(".")
        if not path:
            problems.append(description)
        elif description.startswith("unknown field"):
            problems.append(f"{path}: {description}")
        else:
            problems.append(f"{path} {description}")
    return problems


# --------------------------------------------------------------------------------------
# Decoding helpers
# --------------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} does not fit a double")
    return value


def load_json(
    raw: str | bytes,
    *,
    max_bytes: int,
    too_large: str,
    bad_json: str,
    from_client: bool = True,
) -> Any:
    """Size check, then strict JSON; from a client also no lone surrogates and no
    nesting deeper than `MAX_JSON_DEPTH`.

    NaN/Infinity are refused because they are not JSON: echoing them back in
    ``video.start`` would produce text that browsers' ``JSON.parse`` rejects.
    """
    if isinstance(raw, bytes | bytearray | memoryview):
        data = bytes(raw)
        if len(data) > max_bytes:
            raise ProtocolError(ErrorCode.MESSAGE_TOO_LARGE, too_large)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(ErrorCode.INVALID_JSON, bad_json) from None
    else:
        text = raw
        # Characters are at most 4 UTF-8 bytes: skip encoding what is clearly fine or huge.
        if len(text) > max_bytes or (
            len(text) * 4 > max_bytes and len(text.encode("utf-8", "surrogatepass")) > max_bytes
        ):
            raise ProtocolError(ErrorCode.MESSAGE_TOO_LARGE, too_large)
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_parse_finite_float)
    except (ValueError, RecursionError):
        raise ProtocolError(ErrorCode.INVALID_JSON, bad_json) from None
    problem = _shape_problem(value) if from_client else None
    if problem is not None:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"{bad_json}: {problem}")
    return value


MAX_JSON_DEPTH: Final = 32
"""How deeply a client's JSON may nest. No field of the protocol needs a tenth of it,
and echoing a deeper ``extra_params`` in ``video.start`` ran out of Python's stack
(found by ``bench/fuzz.py``: ``internal_error`` at a depth of a few hundred)."""


_LONE_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def safe_text(text: str) -> str:
    """Client text made fit to send back: lone surrogates written as ``\\udc80``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _shape_problem(value: Any) -> str | None:
    """What makes a client's JSON unfit to go further: the first string (key or value)
    holding a lone surrogate, or nesting deeper than `MAX_JSON_DEPTH`. Iterative, so
    that the check itself cannot run out of stack."""
    pending: list[tuple[str, Any, int]] = [("the top level", value, 0)]
    while pending:
        path, item, depth = pending.pop()
        if isinstance(item, dict | list) and depth >= MAX_JSON_DEPTH:
            return f"{path} nests deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                # JSON can escape half of a UTF-16 pair ("\udc80"). Such a string cannot
                # be encoded as UTF-8: it would break an engine's tokenizer or our reply.
                return f"the string at {path} is not valid Unicode (a lone surrogate)"
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = key if path == "the top level" else f"{path}.{key}"
                if _LONE_SURROGATE.search(key):
                    return (
                        f"the string at {safe_text(child_path)} is not valid Unicode "
                        "(a lone surrogate)"
                    )
                pending.append((child_path, child, depth + 1))
        elif isinstance(item, list):
            pending.extend(
                (f"{path}[{index}]", child, depth + 1) for index, child in enumerate(item)
            )
    return None


def dump_json(payload: dict[str, Any]) -> str:
    # ensure_ascii: a lone surrogate from a "\ud800" escape must not reach a text frame.
    return json.dumps(payload, separators=(",", ":"), allow_nan=False)

"""``parse_control``: what a client sends after ``session.start``, validated.

A server reads every later message of a session here: ``session.stop``,
``session.ping``, ``session.playback`` and ``session.interaction``, whose nested
``interaction.event`` (a prompt, a camera in vllm-omni's ``multi_modal_data`` shape, a
transition) is structured by a cattrs converter of its own, `_CONTROL`, that stops at the
first problem in the reference's order. Apart from `_messages`, which says what each
message is and how it is written (the wire converter, `_WIRE`), because the rules of
what a client may send, and the texts that refuse it, are the larger part and change
on their own; the classes they build, and the wire shape of an interaction
(`InteractionBody`), are `_messages`'.
"""

import math
from collections.abc import Callable, Mapping
from typing import Any, Final

import cattrs
from cattrs.gen import make_dict_structure_fn, override

from trio_vstream.protocol._errors import ErrorCode, ProtocolError
from trio_vstream.protocol._limits import DEFAULT_LIMITS, Limits
from trio_vstream.protocol._messages import (
    ControlMessage,
    InputEnd,
    Interaction,
    InteractionBody,
    InteractionEvent,
    Ping,
    Playback,
    Stop,
)
from trio_vstream.protocol._wire import Invalid, load_json, quote, show
from trio_vstream.values import CAMERA_MODES, Camera

__all__ = ["QUATERNION_TOLERANCE", "parse_control"]


def _event_id(value: Any, _: Any) -> str | None:
    if value is None or (isinstance(value, str) and value):
        return value
    raise Invalid("session.interaction event_id must be a non-empty string")


_NO_PROMPT: Final = "session.interaction requires a non-empty event.prompt"
_MMD: Final = "session.interaction event.multi_modal_data"
#: How far a rotation's norm may be from 1: a client's float32 quaternion is a unit one
#: to about 1e-7, and a hand-written one rounded to three places still passes.
QUATERNION_TOLERANCE: Final = 1e-3


def _prompt(value: Any, _: Any) -> str | None:
    # Absent is fine here (a camera may come instead; `_event` checks that one came).
    # A prompt that is present but empty is still refused, camera or not: it is a
    # client bug (an unfilled text box), not a way to say "keep the prompt".
    if value is None or (isinstance(value, str) and value.strip()):
        return value
    raise Invalid(_NO_PROMPT)


def _only_keys(value: Any, path: str, known: tuple[str, ...]) -> dict[str, Any]:
    """An object with no key but ``known``: an unknown one is named, not ignored."""
    if not isinstance(value, dict):
        raise Invalid(f"{path} must be an object, got {show(value)}")
    for key in value:
        if key not in known:
            raise Invalid(f"{path}: unknown key {quote(key)}")
    return value


def _finite_numbers(value: Any, path: str, count: int) -> tuple[float, ...]:
    # bool is an int subclass, but true is not a coordinate.
    what = f"{path} must be an array of {count} finite numbers"
    if not isinstance(value, list) or len(value) != count:
        raise Invalid(f"{what}, got {show(value)}")
    numbers = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | float):
            raise Invalid(f"{what}, got {show(item)} in it")
        try:
            number = float(item)
        except OverflowError:  # an integer too large for a double
            number = math.inf
        if not math.isfinite(number):
            raise Invalid(f"{what}, got {show(item)} in it")
        numbers.append(number)
    return tuple(numbers)


def _multi_modal_data(value: Any, _: Any) -> Camera | None:
    """``{"camera": {"mode": ..., "data": {"translation": [x,y,z], "rotation": [q]}}}``."""
    if value is None:
        return None
    camera = _only_keys(value, _MMD, ("camera",)).get("camera")
    if camera is None:
        return None
    path = f"{_MMD}.camera"
    camera = _only_keys(camera, path, ("mode", "data"))
    mode = camera.get("mode")
    if not isinstance(mode, str) or mode not in CAMERA_MODES:
        allowed = ", ".join(quote(name) for name in sorted(CAMERA_MODES))
        raise Invalid(f"{path}.mode must be one of {allowed}, got {show(mode)}")
    data = _only_keys(camera.get("data"), f"{path}.data", ("translation", "rotation"))
    # Unpacked, so that the type checker knows the lengths checked here.
    x, y, z = _finite_numbers(data.get("translation"), f"{path}.data.translation", 3)
    qx, qy, qz, qw = _finite_numbers(data.get("rotation"), f"{path}.data.rotation", 4)
    rotation = (qx, qy, qz, qw)
    norm = math.sqrt(sum(q * q for q in rotation))
    if abs(norm - 1.0) > QUATERNION_TOLERANCE:
        raise Invalid(
            f"{path}.data.rotation must be a unit quaternion "
            f"(norm 1 within {QUATERNION_TOLERANCE}), got norm {norm:.6g}"
        )
    return Camera(mode, (x, y, z), rotation)


def _negative_prompt(value: Any, _: Any) -> None:
    if value is not None:
        raise Invalid("session.interaction negative_prompt is not supported in this release")


def _transition_chunks(value: Any, _: Any) -> int | None:
    # Whole floats pass (3.0 is 3), as in the reference; bools are not numbers here.
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and not value.is_integer())
    ):
        raise Invalid("session.interaction transition_chunks must be an integer")
    if value < 0:
        raise Invalid("session.interaction transition_chunks must be >= 0")
    return int(value)


def _object_with(
    inner: Callable[[Any, Any], Any], keys: tuple[str, ...], refusal: str
) -> Callable[[Any, Any], Any]:
    """Refuse a non-object, and give absent keys a null so their hooks run (and refuse)."""

    def hook(value: Any, tp: Any) -> Any:
        if not isinstance(value, dict):
            raise Invalid(refusal)
        return inner({**dict.fromkeys(keys), **value}, tp)

    return hook


def _make_control_converter() -> cattrs.Converter:
    """Structures `InteractionBody`; stops at the first problem, in the reference's order.

    ``detailed_validation`` is off on purpose: the reference reports one problem per
    message (event_id, then event, prompt, negative_prompt, then transition_chunks), and
    the fields are declared in that order.
    """
    converter = cattrs.Converter(detailed_validation=False)
    fields = make_dict_structure_fn(
        InteractionEvent,
        converter,
        prompt=override(struct_hook=_prompt),
        negative_prompt=override(struct_hook=_negative_prompt),
        multi_modal_data=override(struct_hook=_multi_modal_data),
    )

    def event(value: dict[str, Any], tp: Any) -> InteractionEvent:
        # Neither a prompt nor any multi_modal_data: the reference's prompt error, first,
        # as before cameras existed. An empty multi_modal_data is caught after it parsed.
        if value["prompt"] is None and value["multi_modal_data"] is None:
            raise Invalid(_NO_PROMPT)
        result = fields(value, tp)
        if result.prompt is None and result.multi_modal_data is None:
            raise Invalid(_NO_PROMPT)
        return result

    converter.register_structure_hook(
        InteractionEvent,
        _object_with(
            event,
            ("prompt", "negative_prompt", "multi_modal_data"),
            "session.interaction requires event object",
        ),
    )
    body = make_dict_structure_fn(
        InteractionBody,
        converter,
        event_id=override(struct_hook=_event_id),
        transition_chunks=override(struct_hook=_transition_chunks),
    )
    converter.register_structure_hook(
        InteractionBody,
        _object_with(
            body,
            ("event_id", "event", "transition_chunks"),
            "session.interaction requires an interaction object",
        ),
    )
    return converter


_CONTROL: Final = _make_control_converter()


def _parse_interaction(msg: dict[str, Any]) -> Interaction:
    interaction = msg.get("interaction")
    try:
        body = _CONTROL.structure(interaction, InteractionBody)
    except Invalid as exc:
        # Only an id the client chose, and that passed its own check, is worth echoing.
        raw_id = interaction.get("event_id") if isinstance(interaction, dict) else None
        known_id = raw_id if isinstance(raw_id, str) and raw_id else None
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, str(exc), event_id=known_id) from None
    return Interaction(
        event_id=body.event_id,
        prompt=body.event.prompt,
        transition_chunks=body.transition_chunks,
        camera=body.event.multi_modal_data,
    )


_PLAYBACK_POSITION: Final = "session.playback position_seconds must be a finite number >= 0"


def _parse_playback(msg: dict[str, Any]) -> Playback:
    """Missing, not a number (true is not one), negative or beyond a double: refused
    (``invalid_message``); the session goes on. Other keys are ignored, as in `Stop`
    and `Ping`: a client sends this every 100 ms, and one that adds a key of its own
    must not get an error each time. NaN and Infinity never get here: they are not JSON
    (``invalid_json``, from `load_json`)."""
    value = msg.get("position_seconds")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"{_PLAYBACK_POSITION}, got {show(value)}")
    try:
        position = float(value)
    except OverflowError:  # an integer too large for a double
        position = math.inf
    if not math.isfinite(position) or position < 0:
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"{_PLAYBACK_POSITION}, got {show(value)}")
    return Playback(position)


_CONTROL_TYPES: Final[Mapping[str, type[Stop | Ping | InputEnd]]] = {
    cls.TYPE: cls for cls in (Stop, Ping, InputEnd)
}


def parse_control(raw: str | bytes, *, limits: Limits = DEFAULT_LIMITS) -> ControlMessage:
    """Validate a message received after ``session.start``; raises `ProtocolError`.

    Whether an interaction's event_id was already used is session state, so the caller
    checks that (``event_id_conflict``); a missing event_id comes back as None.
    """
    msg = load_json(
        raw,
        max_bytes=limits.max_control_bytes,
        too_large="control message too large",
        bad_json="Invalid JSON message",
    )
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "WebSocket messages must be JSON objects")
    msg_type = msg.get("type")
    if msg_type == Interaction.TYPE:
        return _parse_interaction(msg)
    if msg_type == Playback.TYPE:
        return _parse_playback(msg)
    cls = _CONTROL_TYPES.get(msg_type) if isinstance(msg_type, str) else None
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"Unknown message type: {msg_type}")
    return cls()

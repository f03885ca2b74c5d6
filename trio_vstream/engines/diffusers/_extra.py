"""A request's ``extra_params``: an allow-list per family of pipelines, each value checked.

``extra_params`` reach a pipeline's ``__call__`` (or the loop the engine drives in its
place), so a client could otherwise set anything the call takes: a schedule of a million
steps, a prompt padded to any length, the call's own tensors. So each family of
pipelines (`loops`) declares the keys it takes as `ExtraParams`, each with its check, no
other key (and only those the pipelines' ``__call__`` take), and every value is checked
for type and bounds before the stream opens: an ``invalid_request`` names what is wrong,
and the keys this pipeline takes. A key its family's own loop reads (SkyReels-V2 DF's
window, AnyFlow FAR's chunk partition, FramePack's sections) is declared `by_plan`: the
loop's plan checks it, where the bounds depend on the video.

A key the engine honours itself rather than passing on (Helios' ``is_enable_stage2``,
which the pipeline's class decides) is declared in the family's ``consumed``: its check
accepts only what the pipeline does, refuses anything else by name, and it never reaches
the call. A key another server takes for the family that the engine cannot honour is in
its ``refused``, with the reason the refusal gives.

This module holds the checks the families' lists are made of, and `check_extra_params`,
which applies a list to a request. The server's own ``extra_params`` (pacing, the camera
and interaction scripts, codec options) never get here: the session takes them out
before it opens the stream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from trio_vstream.engines.diffusers._messages import quoted, shown

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo

MAX_STEPS = 200
"""The most denoising steps a request may ask for: the protocol's bound on
``num_inference_steps`` (``VideoRequest``), which a ``sigmas`` or ``timesteps`` schedule
(one step per entry), ``zero_steps`` and ``ar_step`` may not exceed either."""

DEFAULT_MAX_SEQUENCE_LENGTH = 512
"""The cap on ``max_sequence_length`` for a pipeline whose ``__call__`` has no default
for it (Wan's and SkyReels-V2's default, the UMT5 encoder's length)."""

ATTENTION_SCALE = 4.0
"""``attention_kwargs.scale`` (the LoRA layers' scale for the call) is in
``-ATTENTION_SCALE..ATTENTION_SCALE``: the layers are multiplied by it and divided again
after the call, on the pipeline every session shares."""


class Refused(ValueError):
    """A value out of type or bounds; the message names the key and what it takes."""


Check = Callable[[str, Any, Sequence["PipelineInfo"]], Any]
"""A key's check: ``check(key, value, used)`` is ``value`` as the call takes it, or
raises `Refused`; ``used`` are the pipelines the request runs on (its first segment's,
and the following ones')."""


def by_plan(key: str, value: Any, used: Sequence[PipelineInfo]) -> Any:
    """A key the family's loop reads: taken as it is here, and checked by the loop's plan
    against the video (``Loop.plan``)."""
    return value


def max_sequence_length(key: str, value: Any, used: Sequence[PipelineInfo]) -> int:
    """The prompt's token length: 1 up to the pipelines' own default (the text encoder's
    length), or `DEFAULT_MAX_SEQUENCE_LENGTH` where they have none."""
    defaults = [info.default(key) for info in used]
    cap = min(
        (d for d in defaults if isinstance(d, int) and not isinstance(d, bool) and d > 0),
        default=DEFAULT_MAX_SEQUENCE_LENGTH,
    )
    return _whole(key, value, 1, cap)


def attention_kwargs(key: str, value: Any, used: Sequence[PipelineInfo]) -> dict[str, Any]:
    """Only ``scale`` (the LoRA layers' scale for the call), within `ATTENTION_SCALE`."""
    if not isinstance(value, dict) or set(value) - {"scale"}:
        raise Refused(
            f"extra_params.{key} takes only scale (a number from "
            f"{-ATTENTION_SCALE:g} to {ATTENTION_SCALE:g}), got {shown(value)}"
        )
    if "scale" in value:
        _number(f"{key}.scale", value["scale"], -ATTENTION_SCALE, ATTENTION_SCALE)
    return dict(value)


def sigmas(key: str, value: Any, used: Sequence[PipelineInfo]) -> tuple[float, ...]:
    """A sigma schedule: one number in 0..1 per step (`schedule`)."""
    return schedule(key, value, 1.0)


def timesteps(key: str, value: Any, used: Sequence[PipelineInfo]) -> tuple[float, ...]:
    """A timestep schedule: one number per step, in the scheduler's units (0 to its
    ``num_train_timesteps``)."""
    return schedule(key, value, float(_train_timesteps(used[0])))


def flag(key: str, value: Any, used: Sequence[PipelineInfo]) -> bool:
    """True or false, nothing else (no 0, 1 or "true")."""
    if not isinstance(value, bool):
        # Quoted: a string "true" must not read as the boolean it is not.
        raise Refused(f"extra_params.{key} must be true or false, got {quoted(value)}")
    return value


def whole(low: int, high: int) -> Check:
    """The check of an integer from ``low`` to ``high``."""

    def check(key: str, value: Any, used: Sequence[PipelineInfo]) -> int:
        return _whole(key, value, low, high)

    return check


def number(low: float, high: float) -> Check:
    """The check of a number (an integer or a float) from ``low`` to ``high``."""

    def check(key: str, value: Any, used: Sequence[PipelineInfo]) -> float:
        return _number(key, value, low, high)

    return check


COMMON: Mapping[str, Check] = {
    "attention_kwargs": attention_kwargs,
    "max_sequence_length": max_sequence_length,
}
"""What every family takes: the prompt's token length, and the LoRA scale for the call."""


@attrs.frozen
class ExtraParams:
    """The ``extra_params`` one family of pipelines takes, each key with its check."""

    name: str
    """The family, as messages name it ("Helios takes ...")."""
    checks: Mapping[str, Check]
    array_sigmas: bool = False
    """``sigmas`` goes to the call as a numpy array: Helios' scheduler multiplies it by
    ``num_train_timesteps``, which would repeat a list, not scale it."""
    consumed: frozenset[str] = frozenset()
    """Keys of ``checks`` that no ``__call__`` takes: each check accepts only a value the
    pipeline already honours (and refuses any other by name), and the key is not passed on."""
    refused: Mapping[str, str] = attrs.field(factory=dict)
    """Keys another server takes for this family (vllm-omni's) that the engine cannot
    honour, each with the reason its refusal gives."""

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys, sorted."""
        return tuple(sorted(self.checks))


def check_extra_params(
    extra: Mapping[str, Any],
    *,
    family: ExtraParams,
    used: Sequence[PipelineInfo],
    engine_set: Mapping[str, str],
    steps: int | None,
    problems: list[str],
) -> dict[str, Any]:
    """The request's ``extra_params`` that ``family`` takes, checked, as the call (or the
    loop's plan) is to be given them; every problem goes to ``problems``.

    A key outside the family's list, or one the ``used`` pipelines' ``__call__`` does
    not take, is refused by name, with what this pipeline takes (a key the engine sets
    itself with a hint from ``engine_set``: what to use instead). ``steps`` is the
    request's ``num_inference_steps``, which a schedule must agree with.
    """
    model = used[0]
    taken = [
        k for k in family.keys if k in family.consumed or all(info.accepts(k) for info in used)
    ]
    reserved: list[str] = []
    unknown: list[str] = []
    checked: dict[str, Any] = {}
    for key, value in extra.items():
        if key in family.refused:
            problems.append(
                f"extra_params.{key} is not supported by {model.class_name}: {family.refused[key]}"
            )
            continue
        if key not in taken:
            (reserved if key in engine_set else unknown).append(key)
            continue
        try:
            checked[key] = family.checks[key](key, value, used)
        except Refused as exc:
            problems.append(str(exc))
    if reserved:
        hints = [f"{k} (use {engine_set[k]})" if engine_set[k] else k for k in sorted(reserved)]
        problems.append(f"extra_params set by the engine: {', '.join(hints)}")
    if unknown:
        names = sorted(shown(k) for k in unknown)
        listed = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        problems.append(
            f"unknown extra_params for {model.class_name}: {listed} "
            f"({family.name} takes {', '.join(taken) or 'none'})"
        )
    schedules = [k for k in ("sigmas", "timesteps") if k in checked]
    if len(schedules) == 2:
        problems.append("extra_params: give sigmas or timesteps, not both")
    for key in schedules:
        if steps is not None and len(checked[key]) != steps:
            problems.append(
                f"extra_params.{key} has {len(checked[key])} entries, one per step, but "
                f"num_inference_steps is {steps}"
            )
    if family.array_sigmas and "sigmas" in checked:
        checked["sigmas"] = np.asarray(checked["sigmas"], dtype=np.float64)
    return {k: v for k, v in checked.items() if k not in family.consumed}


def schedule_steps(checked: Mapping[str, Any]) -> int | None:
    """The steps a checked ``sigmas`` or ``timesteps`` schedule makes (None: neither)."""
    for key in ("sigmas", "timesteps"):
        if key in checked:
            return len(checked[key])
    return None


def schedule(key: str, value: Any, high: float) -> tuple[float, ...]:
    """A ``sigmas`` or ``timesteps`` list: one finite number in ``0..high`` per step, at
    most `MAX_STEPS` (the schedule sets the number of steps: each is a transformer pass)."""
    if (
        not isinstance(value, (list, tuple))
        or not 1 <= len(value) <= MAX_STEPS
        or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= high
            for v in value
        )
    ):
        raise Refused(
            f"extra_params.{key} must be a list of 1 to {MAX_STEPS} numbers from 0 to "
            f"{high:g}, one per step, got {shown(value)}"
        )
    return tuple(float(v) for v in value)


def _whole(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise Refused(
            f"extra_params.{key} must be an integer from {low} to {high}, got {shown(value)}"
        )
    return value


def _number(key: str, value: Any, low: float, high: float) -> float:
    # The range check also refuses NaN and the infinities (they compare false).
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise Refused(
            f"extra_params.{key} must be a number from {low:g} to {high:g}, got {shown(value)}"
        )
    return float(value)


def _train_timesteps(info: PipelineInfo) -> int:
    """The scheduler's ``num_train_timesteps`` (the unit of ``timesteps``), else 1000."""
    config = getattr(getattr(info.pipe, "scheduler", None), "config", None)
    value = getattr(config, "num_train_timesteps", None)
    if value is None and isinstance(config, Mapping):
        value = config.get("num_train_timesteps")
    return value if isinstance(value, int) and value > 0 else 1000

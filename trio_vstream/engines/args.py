"""Parsing ``--engine-arg KEY=VALUE`` options, for engine factories.

Not part of the engine contract (`trio_vstream.engines.contract`, where a factory receives
its engine args as strings): helpers the built-in engines share, and a lab's engine
may use, so that a bad option fails at start-up with the same kind of message.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from trio_vstream.engines.contract import EngineConfigError

__all__ = ["parse_bool_arg", "parse_number_arg", "reject_unknown_args"]


def reject_unknown_args(engine: str, args: Mapping[str, str], known: Iterable[str]) -> None:
    """A typo in ``--engine-arg`` fails at start-up, naming the key and what is known."""
    known = sorted(known)
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise EngineConfigError(
            f"{engine} engine: unknown engine arg(s) {', '.join(unknown)}; "
            f"known: {', '.join(known)}"
        )


def parse_number_arg(
    engine: str,
    name: str,
    raw: str,
    kind: type[int] | type[float],
    *,
    minimum: float,
    maximum: float | None = None,
) -> Any:
    """One numeric ``--engine-arg``: parsed as ``kind`` and range-checked, or an
    ``EngineConfigError`` naming the engine, the key and what was wrong."""
    try:
        value = kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise EngineConfigError(f"{engine} engine: {name} must be {what}, got {raw!r}") from None
    if not math.isfinite(value) or value < minimum:
        raise EngineConfigError(f"{engine} engine: {name} must be >= {minimum}, got {raw}")
    if maximum is not None and value > maximum:
        raise EngineConfigError(f"{engine} engine: {name} must be <= {maximum}, got {raw}")
    return value


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool_arg(engine: str, name: str, raw: str) -> bool:
    """One on/off ``--engine-arg``: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/
    ``off`` (any case); anything else is an ``EngineConfigError`` naming the key."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise EngineConfigError(f"{engine} engine: {name} must be 1 or 0 (true or false), got {raw!r}")

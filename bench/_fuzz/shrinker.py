"""Shrinking a violation's input to a small one that still shows it.

Greedy, on the JSON value (keys, items, characters), else on the text; Hypothesis' own
shrinker would need the server inside the Hypothesis test, and each try here is a round
trip to a real server.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, AnyStr

import trio

from bench._fuzz.wire import (
    Raw,
    Wire,
    to_json,
    wire_size,
)


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
            to_json(value)  # too deep to write back (a recursion): shrink the raw text only
        except (ValueError, RecursionError):
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
        # Each branch its own type: AnyStr takes str or bytes, not their union.
        if isinstance(best, str):
            await _shrink_text(best, attempt)
        else:
            await _shrink_text(best, attempt)
    except _OutOfBudget:
        pass
    return best, tries


async def _shrink_text(wire: AnyStr, attempt: Callable[[Wire], Awaitable[bool]]) -> None:
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

"""The fuzz's shrinker (``bench/_fuzz/shrinker.py``): JSON loses keys and characters,
other text loses chunks, while the failure persists.
"""

from __future__ import annotations

import json

import trio

from bench._fuzz.oracle import lone_surrogates
from bench._fuzz.shrinker import shrink
from bench._fuzz.wire import Wire, to_json


async def test_shrink_finds_the_small_input_that_still_fails() -> None:
    async def has_lone_surrogate_prompt(wire: Wire) -> bool:
        try:
            value = json.loads(wire)
        except ValueError:
            return False
        prompt = value.get("prompt") if isinstance(value, dict) else None
        return isinstance(prompt, str) and bool(lone_surrogates(prompt))

    wire = to_json(
        {"type": "session.start", "prompt": "ab\udc80cd", "width": 64, "lora": {"x": [1, 2]}}
    )
    small, tries = await shrink(wire, has_lone_surrogate_prompt, deadline=trio.current_time() + 30)
    assert small == '{"prompt":"\\udc80"}'
    assert 0 < tries < 300


async def test_shrink_cuts_text_that_is_not_json() -> None:
    async def says_bad(wire: Wire) -> bool:
        return "BAD" in wire

    small, _ = await shrink("xxxxxxxx{BAD]]]]", says_bad, deadline=trio.current_time() + 30)
    assert small == "BAD"


async def test_shrink_survives_input_nested_too_deeply_to_write_back() -> None:
    """Found by the long fuzz: a failing input nested thousands deep broke the shrinker's
    own JSON writer (a recursion); it now shrinks such input as text."""

    async def is_deep(wire: Wire) -> bool:
        return wire.count("[") >= 5000

    deep = '{"x":' + "[" * 6000 + "]" * 6000 + "}"
    small, tries = await shrink(deep, is_deep, deadline=trio.current_time() + 30, max_tries=60)
    assert is_deep and small.count("[") >= 5000 and len(small) <= len(deep)
    assert tries > 0

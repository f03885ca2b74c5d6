"""What a `check_engine` run reports: the rules by name (`RULES`), each broken one
(`Violation`), and all of them together (`EngineContractError`).

Kept apart from the checks so that the names an engine's tests read (a rule's name, the
error they catch) are defined once, in one short module that each rule's module imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs

RULES: Final[dict[str, str]] = {
    "interface": "the engine and its streams have the contract's members, and what they "
    "declare beyond it (interaction kinds, max_batch, a seed) is well formed",
    "chunks": "a stream runs to its end, in chunks numbered 0, 1, ... that hold (T, H, W, 3) "
    "uint8 frames of the request's size, num_frames in all",
    "checkpoint": "next_chunk calls checkpoint() before the work of every chunk it returns",
    "stop": "a checkpoint that raises ends next_chunk at once, with that exception and no "
    "further step",
    "close": "close() returns after any ending: a stream finished, stopped, failed or never "
    "stepped, and the engine at the end",
    "cancellation": "after a stream is stopped at any checkpoint, or fails, the engine serves "
    "the next stream",
    "interact": "interact only queues: it returns while next_chunk waits in a checkpoint, and "
    "the change starts at the next chunk, a change received mid-window (window_offset in "
    "(0, 1)) too",
    "batching": "an engine with max_batch > 1 makes the same frames for rows stepped together "
    "as for rows stepped alone",
    "deferred": "a chunk whose frames are DeferredFrames decodes to the same frames when the "
    "server decodes it: in another thread, after the stream's next chunk and its close; and "
    "one released instead of decoded, as after a stop, leaves the engine serving",
    "audio": "an engine with sound (audio_sample_rate) declares a rate and channels the server "
    "carries, and each chunk's audio covers exactly its frames: audio_samples_through(end) - "
    "audio_samples_through(start) samples, float PCM",
    "video_input": "an engine that takes input video (video_input) opens, for a request with "
    "input_video, a stream that is FollowsInput: next_chunk_frames is a positive int, and each "
    "chunk fed that many (T, H, W, 3) uint8 input frames has exactly that many frames",
}
"""Each rule `check_engine` checks, by the name it reports it under."""


@attrs.frozen
class Violation:
    """One broken rule: its name (a key of `RULES`) and what the engine did."""

    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


class EngineContractError(AssertionError):
    """The engine broke the contract; ``violations`` says how, rule by rule."""

    def __init__(self, engine: str, violations: Sequence[Violation]) -> None:
        self.violations = tuple(violations)
        lines = "\n".join(f"  {violation}" for violation in self.violations)
        super().__init__(f"engine {engine!r} broke the engine contract:\n{lines}")

    @property
    def rules(self) -> frozenset[str]:
        """The names of the rules broken."""
        return frozenset(violation.rule for violation in self.violations)

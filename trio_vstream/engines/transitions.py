"""Prompt transitions with the reference's semantics, for any engine.

A ``session.interaction`` changes the prompt at the next chunk boundary and
blends the conditioning from the old prompt to the new one over
``transition_chunks`` chunks: the n-th chunk generated with the event uses
``alpha = n / transition_chunks`` (0 means a hard switch), so the target is
reached on the N-th chunk after the boundary. A new event that arrives while
another is still blending supersedes it: the blend restarts from whatever mix
the last chunk used. Conditioning is therefore a weighted mix of prompts, and
an engine turns it into embeddings by mixing each prompt's embedding with the
same weights (a lerp when two prompts are involved).

The per-chunk event ids follow the reference: ``started`` on the first chunk
generated with the event, ``active`` while it is blending, ``completed`` on
the chunk that reaches the target or when a newer event supersedes it.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import attrs

from trio_vstream.engines.contract import Chunk, PromptChange

DEFAULT_TRANSITION_CHUNKS = 3


@attrs.frozen
class ChunkConditioning:
    """What one chunk is generated from."""

    mix: tuple[tuple[str, float], ...]
    """(prompt, weight) pairs, weights summing to 1, heaviest first."""
    started_event_ids: tuple[str, ...] = ()
    active_event_ids: tuple[str, ...] = ()
    completed_event_ids: tuple[str, ...] = ()

    @property
    def prompt(self) -> str:
        """The dominant prompt: for engines that cannot blend."""
        return self.mix[0][0]

    def chunk(self, frames: Any, index: int) -> Chunk:
        """The chunk generated from this conditioning, carrying its event ids."""
        return Chunk(
            frames=frames,
            index=index,
            started_event_ids=self.started_event_ids,
            active_event_ids=self.active_event_ids,
            completed_event_ids=self.completed_event_ids,
        )


@attrs.define
class _Transition:
    event_id: str
    target: str
    chunks: int
    source: dict[str, float]
    elapsed: int = 0

    @property
    def alpha(self) -> float:
        return 1.0 if self.chunks == 0 else min(1.0, self.elapsed / self.chunks)

    def mix(self) -> dict[str, float]:
        alpha = self.alpha
        weights = {prompt: (1.0 - alpha) * w for prompt, w in self.source.items()}
        weights[self.target] = weights.get(self.target, 0.0) + alpha
        return {prompt: w for prompt, w in weights.items() if w > 1e-9}


class PromptSchedule:
    """Queues prompt changes from any thread; yields one conditioning per chunk.

    ``push`` is called by the server's event loop thread while the engine's
    worker thread may be inside ``next_conditioning``; a lock keeps the queue
    consistent, and nothing else is shared.
    """

    def __init__(
        self, prompt: str, *, default_transition_chunks: int = DEFAULT_TRANSITION_CHUNKS
    ) -> None:
        self._mix: dict[str, float] = {prompt: 1.0}
        self._default_chunks = default_transition_chunks
        # Each change with its prompt, which `push` checked is there.
        self._pending: deque[tuple[PromptChange, str]] = deque()
        self._lock = threading.Lock()
        self._transition: _Transition | None = None

    def push(self, change: PromptChange) -> None:
        """Queue a change for the next chunk boundary.

        A camera-only change has no prompt to blend to: an engine that takes cameras
        handles those itself. Refused here, at once, rather than as a broken mix later.
        """
        prompt = change.prompt
        if prompt is None:
            raise ValueError(f"PromptSchedule needs a prompt; change {change.event_id} has none")
        with self._lock:
            self._pending.append((change, prompt))

    def next_conditioning(self) -> ChunkConditioning:
        """Advance one chunk boundary and say what the new chunk is generated from."""
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        started: list[str] = []
        completed: list[str] = []
        for change, prompt in pending:
            if self._transition is not None:
                completed.append(self._transition.event_id)  # superseded
            chunks = change.transition_chunks
            self._transition = _Transition(
                event_id=change.event_id,
                target=prompt,
                chunks=self._default_chunks if chunks is None else chunks,
                source=dict(self._mix),
            )
            started.append(change.event_id)
        active: list[str] = []
        if self._transition is not None:
            self._transition.elapsed += 1
            self._mix = self._transition.mix()
            if self._transition.alpha >= 1.0:
                completed.append(self._transition.event_id)
                self._transition = None
            else:
                active.append(self._transition.event_id)
        mix = tuple(sorted(self._mix.items(), key=lambda item: -item[1]))
        return ChunkConditioning(
            mix=mix,
            started_event_ids=tuple(started),
            active_event_ids=tuple(active),
            completed_event_ids=tuple(completed),
        )

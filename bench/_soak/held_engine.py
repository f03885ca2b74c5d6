"""The soak's batched engine: ``shapes``, batching 4 sessions' steps, whose batched step
can be held, outside any checkpoint, for as long as the soak wants (a hung forward).

``--engine bench._soak.held_engine:create_engine --engine-arg hold_dir=DIR``. A session
whose ``extra_params`` carry ``"hold": TOKEN`` steps in a group of its own with every
session of the same token (the server's `StepBatcher` batches rows per batched-step
function, and the sessions of one token share one: `HeldStep`). A batch of two or more
of their rows blocks in its thread, taking no checkpoint, until a file named TOKEN
exists in ``DIR``; then it runs as the shapes engine's step and returns. So two sessions
sharing a token wedge the server's batcher for as long as the soak leaves that file
uncreated, and the soak releases them by creating it. One session alone never blocks
(its steps run alone, as an unbatched step would), nor does a session without a token.

The token comes from a client: it names a file only after it has matched `HOLD_TOKEN`
(lower-case letters, digits and ``-``, 32 at most: no ``/``, no ``.``), and only inside
``DIR``, which the soak's command line gives; anything else is refused as an invalid
request. A hold ends by itself after `HOLD_SECONDS_MAX` (an `EngineError` for the
batch), so that a soak that died without releasing leaves no thread blocked for good.

Everything else is the shapes engine's: its ``--engine-arg`` options (``max_batch``
defaults to 4 here), its requests (``extra_params.chunk_frames`` besides ``hold``), its
frames.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, cast

import attrs

from bench._soak.settings import BATCHED_MAX_SESSIONS, HOLD_PARAM, HOLD_TOKEN
from trio_vstream.engines.contract import (
    EngineConfigError,
    EngineError,
    GenerationRequest,
    InvalidRequestError,
)
from trio_vstream.engines.shapes import ShapesEngine, ShapesStream
from trio_vstream.engines.shapes import create_engine as create_shapes
from trio_vstream.logsafe import get_logger
from trio_vstream.models.shapes.sampler import StepInput

logger = get_logger(__name__)

HOLD_POLL_S: Final = 0.01
"""How often a held batch looks for its file."""
HOLD_SECONDS_MAX: Final = 300.0
"""The longest a batch is held without its file: then it fails (the soak is gone)."""
MAX_BATCH: Final = BATCHED_MAX_SESSIONS
"""Sessions whose steps run as one batch, unless ``--engine-arg max_batch`` says other."""

StepResults = list[Any]
RunBatch = Callable[[Sequence[StepInput]], StepResults]


def hold_token(extra_params: Any) -> str | None:
    """A request's hold token, checked (None: it has none)."""
    if not isinstance(extra_params, dict) or HOLD_PARAM not in extra_params:
        return None
    token = extra_params[HOLD_PARAM]
    if not isinstance(token, str) or not HOLD_TOKEN.fullmatch(token):
        raise InvalidRequestError(
            f"extra_params.{HOLD_PARAM} must be 1 to 32 of a-z, 0-9 and '-', got {token!r}"
        )
    return token


@attrs.frozen
class HeldStep:
    """The batched step of the sessions of one hold token: the shapes engine's, held in a
    batch of two rows or more until the token's file exists.

    Equal (and hashed alike) for one token and directory, so that the sessions of one
    token, each with its own instance, batch together, and apart from the others."""

    token: str
    path: Path
    """Where the token's file must appear (the hold directory, the token's name)."""
    run: RunBatch = attrs.field(eq=False, repr=False)
    """The shapes engine's batched step."""
    held: threading.Event = attrs.field(eq=False, repr=False, factory=threading.Event)
    """Set once a batch of this instance is being held (for tests)."""

    def __call__(self, steps: Sequence[StepInput]) -> StepResults:
        if len(steps) >= 2:
            self.hold(len(steps))
        return self.run(steps)

    def hold(self, rows: int) -> None:
        """Block, outside any checkpoint, until the token's file exists (bounded)."""
        if self.path.exists():
            return
        logger.warning("held engine: a batch of %d rows held until %s exists", rows, self.path)
        self.held.set()
        deadline = time.monotonic() + HOLD_SECONDS_MAX
        while not self.path.exists():
            if time.monotonic() >= deadline:
                raise EngineError(f"held engine: {self.path} never appeared")
            time.sleep(HOLD_POLL_S)
        logger.warning("held engine: %s exists: the batch goes on", self.path)


class _HeldShapes:
    """The shapes engine as one held stream sees it: its own in everything but the
    batched step, which is the stream's token's `HeldStep`."""

    def __init__(self, engine: ShapesEngine, run_batch: HeldStep) -> None:
        self._engine = engine
        self.run_batch = run_batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


class HeldEngine:
    """The shapes engine, with held streams (`HeldStep`) for requests with a token."""

    name = "held"

    def __init__(self, shapes: ShapesEngine, hold_dir: Path) -> None:
        self.shapes = shapes
        self.hold_dir = hold_dir
        self.video_defaults = shapes.video_defaults
        self.max_concurrent_steps = shapes.max_concurrent_steps
        self.max_batch = shapes.max_batch
        self.interaction_kinds = shapes.interaction_kinds

    def open_stream(self, request: GenerationRequest) -> ShapesStream:
        token = hold_token(request.extra_params)
        if token is None:
            return self.shapes.open_stream(request)
        rest = {k: v for k, v in request.extra_params.items() if k != HOLD_PARAM}
        request = attrs.evolve(request, extra_params=rest)
        step = HeldStep(token, self.hold_dir / token, self.shapes.run_batch)
        # ShapesStream uses its engine's model, settings and embeddings, and its
        # run_batch as the batched step: the view gives it the token's.
        return ShapesStream(cast(ShapesEngine, _HeldShapes(self.shapes, step)), request)

    def close(self) -> None:
        self.shapes.close()


def create_engine(*, device: str = "auto", **engine_args: str) -> HeldEngine:
    """``--engine bench._soak.held_engine:create_engine --engine-arg hold_dir=DIR``, and
    the shapes engine's options (``max_batch`` 4 by default)."""
    raw = engine_args.pop("hold_dir", None)
    if raw is None:
        raise EngineConfigError("held engine: --engine-arg hold_dir=DIR is required")
    hold_dir = Path(raw)
    if not hold_dir.is_dir():
        raise EngineConfigError(f"held engine: hold_dir {hold_dir} is not a directory")
    shapes = create_shapes(device=device, **{"max_batch": str(MAX_BATCH), **engine_args})
    logger.info("held engine: holds batches until their token's file exists in %s", hold_dir)
    return HeldEngine(shapes, hold_dir.resolve())

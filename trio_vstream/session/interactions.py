"""A session's live interactions: which ones it accepts, and when its engine gets each.

A ``session.interaction`` passes four checks in order, and the first it fails is the
client's answer: its event id is new to the session; the engine takes its kinds (an
engine only ever sees the kinds it declared: a prompt-only engine could not act on a
camera, and would fail or, worse, drop it in silence); a scripted session's camera is
the script's (as in vllm-omni: a live camera would be overridden at the next scripted
chunk); and the pending queue has room (`interaction_queue`: at most 64). Generation
being over fails it too: nothing can take the change any more.

An accepted interaction is then handed to the engine at once, or, in a paced camera
session, held for the chunk whose action window it came in (`interaction_queue`), and
handed over when that chunk starts (`Interactions.take_due`). A refusal at any point
leaves its event id unused, so that the client may retry with it.

When the video ends (its last chunk made, a stop, an engine failure), the interactions
still held are refused (`Interactions.end`: ``interaction_failed``, `VIDEO_ENDED`): they
were acknowledged, and the chunk they waited for will never start. Any interaction that
comes after that is refused at receipt, with the same words.

No socket and no Trio: the session sends what this decides (``session.interaction.queued``,
an error, or the end of the video request when the queue is full), so each rule is tested
by calling it.
"""

from __future__ import annotations

from collections.abc import Iterable

from trio_vstream import protocol
from trio_vstream.engines.contract import EngineError, EngineStream, PromptChange
from trio_vstream.logsafe import get_logger
from trio_vstream.protocol import ErrorCode
from trio_vstream.session.endings import SessionError
from trio_vstream.session.interaction_queue import InteractionQueue
from trio_vstream.session.scripts import Scripts, kinds_refusal

__all__ = ["VIDEO_ENDED", "Interactions"]

logger = get_logger(__name__)

VIDEO_ENDED = "Failed to apply interaction: the video ended before its chunk started"
"""The refusal of an interaction that no chunk will take: the video ended."""


class Interactions:
    """One session's interactions: its event ids, its scripts and its pending queue."""

    def __init__(self, kinds: frozenset[str]) -> None:
        self.kinds = kinds
        """The interaction kinds the engine declared."""
        self.request_id: str | None = None
        """For logs, once the session has one."""
        self.event_ids: set[str] = set()
        """Every event id in use: accepted live ones and the scripts' own."""
        self.scripts = Scripts()
        """The request's scripted interactions, handed to the engine before their chunks."""
        self.queue = InteractionQueue()
        """Its pending interactions, bounded (`trio_vstream.session.interaction_queue`)."""
        self.ended = False
        """The video ended (`end`): no chunk will take an interaction any more."""

    def prepared(self, scripts: Scripts, queue: InteractionQueue) -> None:
        """The request's scripts and its queue (paced or not), once ``session.start`` is
        checked."""
        self.scripts, self.queue = scripts, queue
        self.event_ids |= scripts.event_ids

    def accept(
        self,
        event_id: str,
        message: protocol.Interaction,
        stream: EngineStream | None,
        now: float,
    ) -> SessionError | None:
        """Hand the interaction to ``stream`` (``None`` once generation is over), or
        hold it for its action window, received at ``now``; else say why not.

        ``interaction_queue_full`` is the one refusal that ends the video request: the
        session decides what that means for the client.
        """
        if event_id in self.event_ids:
            return ErrorCode.EVENT_ID_CONFLICT, "event_id_conflict"
        change = PromptChange(event_id, message.prompt, message.transition_chunks, message.camera)
        refusal = kinds_refusal(change.kinds, self.kinds)
        if refusal is not None:
            return ErrorCode.INTERACTION_FAILED, refusal
        if change.camera is not None and self.scripts.owns_camera:
            return ErrorCode.INTERACTION_FAILED, (
                f"this session's camera follows its extra_params.{protocol.CAMERA_SCRIPT_PARAM}"
            )
        if stream is None:  # generation is over; nothing can take the change
            return ErrorCode.INTERACTION_FAILED, "Failed to apply interaction"
        if self.ended:  # the stream is still open, but it makes no more chunks
            return ErrorCode.INTERACTION_FAILED, VIDEO_ENDED
        if self.queue.full:
            return ErrorCode.INTERACTION_QUEUE_FULL, (
                f"Interaction queue full: {self.queue.limit} interactions pending; "
                f"event {event_id[:64]!r} ends the video request"
            )
        self.event_ids.add(event_id)
        if self.queue.windows:  # handed over when its chunk starts (`take_due`)
            self.queue.hold(change, now)
            return None
        return self._hand_over(stream, change)

    @property
    def deadline(self) -> float | None:
        """When the next chunk may start: a paced camera session's window deadline."""
        return self.queue.deadline

    def chunk_generated(
        self, started_event_ids: Iterable[str], began: float, seconds: float, frame: float
    ) -> None:
        """A chunk that began at ``began`` made ``seconds`` of media and started these
        interactions: they are pending no more, and its action window opens (snapped to
        the last deadline within one ``frame``: see `InteractionQueue.open_window`)."""
        self.queue.started(started_event_ids)
        self.queue.open_window(began, seconds, snap=frame)

    def take_due(self, stream: EngineStream) -> list[tuple[str, SessionError]]:
        """Hand the engine the interactions held for the chunk about to start; the
        event id and refusal of each one it refuses now (the client is told then)."""
        refused = []
        for change in self.queue.take():
            refusal = self._hand_over(stream, change)
            if refusal is not None:
                refused.append((change.event_id, refusal))
        return refused

    def end(self) -> list[tuple[str, SessionError]]:
        """The video ended: the event id and refusal of each interaction still held,
        in the order received (the client is told, before the terminal message); from
        now on every interaction is refused at receipt."""
        self.ended = True
        refused = []
        for change in self.queue.drop():
            self.event_ids.discard(change.event_id)
            refused.append((change.event_id, (ErrorCode.INTERACTION_FAILED, VIDEO_ENDED)))
        return refused

    def _hand_over(self, stream: EngineStream, change: PromptChange) -> SessionError | None:
        """Give the engine an accepted interaction; a refusal frees its event id."""
        try:
            stream.interact(change)
        except Exception as exc:
            self.event_ids.discard(change.event_id)
            if isinstance(exc, EngineError):  # the engine refuses it and says why
                return ErrorCode.INTERACTION_FAILED, f"Failed to apply interaction: {exc}"
            logger.exception("session %s: failed to apply interaction", self.request_id)
            return ErrorCode.INTERACTION_FAILED, "Failed to apply interaction"
        self.queue.handed(change.event_id)
        return None

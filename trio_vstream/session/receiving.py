"""The receive loop: what a client sends during its session, read and answered.

A session reads its socket for its whole life, in a task of its own, so that a ping is
answered and a stop takes effect even while the engine is busy or a chunk is being sent:
the replies are queued on the `Sender` (`Sender.reply`), never sent by this task, so it
never waits for the socket. While the session prepares, before this loop starts, what
arrives is held (`hold_early_messages`, `EarlyMessages`) and read first here, in order.

What a message does to the session goes back through three callbacks (a stop, a
disconnect, progress for the stall guard): the session's nursery and its ending stay in
`trio_vstream.session.session`; this is the part that reads, validates and answers.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from trio_vstream import protocol
from trio_vstream.logsafe import get_logger
from trio_vstream.outputs.taps import TapSet
from trio_vstream.protocol import ErrorCode
from trio_vstream.session.calls import SessionCalls
from trio_vstream.session.early_messages import EarlyMessages, OversizedFrame, binary_refusal
from trio_vstream.session.endings import Ending, Outcome, SessionError
from trio_vstream.session.input_video import InputVideo
from trio_vstream.session.interactions import Interactions
from trio_vstream.session.pacing import PlaybackGate
from trio_vstream.session.sending import Sender

# The session's logger: these are its lines, under the name they had in `session`.
logger = get_logger("trio_vstream.session.session")


async def hold_early_messages(
    ws: WebSocketConnection, early: EarlyMessages, disconnected: Callable[[], None]
) -> None:
    """Read while the session prepares: a close is a disconnect now, not after the
    preparation; messages wait for the receive loop, in order, as many as
    `EarlyMessages` keeps (a few, and few bytes)."""
    while not early.full:
        try:
            raw = await ws.get_message()
        except ConnectionClosed:
            disconnected()
            return
        early.keep(raw)


class Receiver:
    """A streaming session's receive loop (`run`), from ``video.start`` to its end.

    An interaction goes to the engine stream ``calls`` holds while it holds one.
    ``stop_requested`` is called for a ``session.stop``, ``disconnected`` when the client
    closes, ``progress`` for a ping (a sign of life for the stall guard), and ``stop``
    when an interaction cannot be kept (a full queue ends the video request).
    """

    def __init__(
        self,
        ws: WebSocketConnection,
        request_id: str,
        *,
        limits: protocol.Limits,
        sender: Sender,
        interactions: Interactions,
        calls: SessionCalls,
        gate: PlaybackGate | None,
        taps: TapSet,
        ending: Ending,
        stop_requested: Callable[[], None],
        stop: Callable[[Outcome, SessionError], None],
        disconnected: Callable[[], None],
        progress: Callable[[], None],
        input_video: InputVideo | None = None,
    ) -> None:
        self._ws = ws
        self._request_id = request_id
        self._limits = limits
        self._sender = sender
        self._interactions = interactions
        self._calls = calls
        self._gate = gate
        self._taps = taps
        self._ending = ending
        self._stop_requested = stop_requested
        self._stop = stop
        self._disconnected = disconnected
        self._progress = progress
        self._input = input_video

    async def run(self, early: EarlyMessages) -> None:
        """Read until the client closes: the messages held while preparing, then the socket."""
        while True:
            try:
                raw = early.pop() if early else await self._ws.get_message()
            except ConnectionClosed:
                self._disconnected()
                return
            if isinstance(raw, bytes | OversizedFrame) and self._input is not None:
                # Vetted and queued (never waiting for a decode), or refused unread.
                if isinstance(raw, OversizedFrame):
                    refusal: protocol.ProtocolError | None = self._input.oversized(raw.length)
                else:
                    refusal = self._input.offer(raw)
                if refusal is not None:
                    await self.refuse_frame(refusal)
                continue
            try:
                if isinstance(raw, protocol.ProtocolError):
                    raise raw  # refused while the session prepared
                if isinstance(raw, bytes | OversizedFrame):
                    raise binary_refusal()
                message = protocol.parse_control(raw, limits=self._limits)
            except protocol.ProtocolError as exc:
                await self._sender.reply(protocol.Error.from_protocol_error(exc, self._request_id))
                continue
            if isinstance(message, protocol.Stop):
                self._stop_requested()
                # Keep reading: a client may still ping while the stream winds down.
            elif isinstance(message, protocol.Ping):
                self._progress()
                await self._sender.reply(protocol.Pong())  # queued: a stop behind it is read now
            elif isinstance(message, protocol.InputEnd):
                if self._input is None:
                    error = protocol.ProtocolError(
                        ErrorCode.INVALID_MESSAGE,
                        "input_video.end: this session asked for no input_video",
                    )
                    await self._sender.reply(
                        protocol.Error.from_protocol_error(error, self._request_id)
                    )
                else:
                    self._input.end()
            elif isinstance(message, protocol.Playback):
                if self._gate is not None:  # ignored unless the client asked for a buffer
                    self._gate.report(message.position_seconds)
            else:
                await self._interact(message)

    async def refuse_frame(self, refusal: protocol.ProtocolError) -> None:
        """An input frame was refused (here, or by the decoder): the client is told, and a
        session that asked for ``input_video.strict`` ends with the same error."""
        assert self._input is not None
        if self._input.settings.strict and self._ending.outcome is None:
            logger.info("session %s: %s (strict input)", self._request_id, refusal.message)
            self._stop(Outcome.FAILED, (refusal.code, refusal.message))
            return
        await self._sender.reply(protocol.Error.from_protocol_error(refusal, self._request_id))

    async def _interact(self, message: protocol.Interaction) -> None:
        # The protocol stays pure: an id the client left out is minted here.
        event_id = message.event_id if message.event_id is not None else uuid.uuid4().hex
        refusal = self._interactions.accept(
            event_id, message, self._calls.stream, trio.current_time()
        )
        if refusal is not None and refusal[0] is ErrorCode.INTERACTION_QUEUE_FULL:
            if self._ending.outcome is None:
                # As in vllm-omni: never dropped in silence; the video request ends with
                # it (the terminal error says so), and later ones get a control error.
                logger.warning("session %s: %s", self._request_id, refusal[1])
                error = protocol.Error(*refusal, request_id=self._request_id, event_id=event_id)
                self._taps.call("interaction", event_id, message, error)
                self._stop(Outcome.FAILED, refusal)
                return
            refusal = ErrorCode.INTERACTION_FAILED, f"Failed to apply interaction: {refusal[1]}"
        if refusal is None:
            self._taps.call("interaction", event_id, message, None)
            await self._sender.reply(protocol.InteractionQueued(self._request_id, event_id))
            return
        error = protocol.Error(*refusal, request_id=self._request_id, event_id=event_id)
        self._taps.call("interaction", event_id, message, error)
        await self._sender.reply(error)

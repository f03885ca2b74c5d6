"""Error codes of the wire protocol, and the one exception its parsers raise.

A module of its own because everything else in the package, and the server, speak of
these. Like h11's and wsproto's errors it imports nothing from the package, so every
other module may import it: the wire ``error`` message that answers a `ProtocolError`
is built where messages live (`_messages.Error.from_protocol_error`).
"""

import enum

__all__ = ["ErrorCode", "ProtocolError"]


class ErrorCode(enum.StrEnum):
    """Machine-readable ``code`` of an ``error`` message; clients branch on these."""

    INVALID_JSON = "invalid_json"
    INVALID_MESSAGE = "invalid_message"
    UNKNOWN_TYPE = "unknown_type"
    MESSAGE_TOO_LARGE = "message_too_large"
    START_TIMEOUT = "start_timeout"
    STALL_TIMEOUT = "stall_timeout"
    MODEL_MISMATCH = "model_mismatch"
    INVALID_REQUEST = "invalid_request"
    EVENT_ID_CONFLICT = "event_id_conflict"
    INTERACTION_FAILED = "interaction_failed"
    INTERACTION_QUEUE_FULL = "interaction_queue_full"
    """An interaction found the session's pending queue full (``MAX_PENDING_INTERACTIONS``):
    as in vllm-omni, the video request ends with this error (terminal)."""
    GENERATION_FAILED = "generation_failed"
    ENCODING_FAILED = "encoding_failed"
    INTERNAL_ERROR = "internal_error"
    SERVER_BUSY = "server_busy"
    SERVER_SHUTDOWN = "server_shutdown"
    # This project's extension: a server whose engine is wedged steps aside.
    ENGINE_UNAVAILABLE = "engine_unavailable"
    """The engine has calls stuck after their sessions ended, as many as the server
    tolerates (``--max-stuck-calls``): new sessions are refused (an HTTP 503 before the
    upgrade, this code after it) so that a client tries another server."""
    # This project's extension: a session that follows an input video (``input_video``).
    INVALID_INPUT_FRAME = "invalid_input_frame"
    """An input frame was refused before or while decoding (not the declared format or
    size, malformed, over the decode rate is not this: that is only counted). The session
    goes on (the frame counts as dropped), or ends with this error if it asked for
    ``input_video.strict``."""
    # This project's extensions, for viewers of a watch link (trio_vstream.outputs.watch):
    READ_ONLY = "read_only"
    """A viewer sent a control message only the session's owner may send."""
    WATCH_NOT_FOUND = "watch_not_found"
    """No running session at this watch link (a wrong token, or the session has ended)."""
    VIEWER_TOO_SLOW = "viewer_too_slow"
    """A viewer fell too far behind the stream and was closed."""


class ProtocolError(Exception):
    """A message the client sent was rejected; carries what goes into the `error` message."""

    def __init__(self, code: ErrorCode, message: str, *, event_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.event_id = event_id

    def __repr__(self) -> str:
        return f"ProtocolError({self.code!r}, {self.message!r}, event_id={self.event_id!r})"

"""`EarlyMessages`, without a session: what is kept of what a client sends while its
session prepares, in which order, and when reading stops. (tests/security/
test_early_messages.py attacks the same bound through a session.)"""

from __future__ import annotations

import json

from trio_vstream import protocol
from trio_vstream.session.early_messages import EARLY_MESSAGES, EarlyMessages, OversizedFrame

PING = json.dumps({"type": "session.ping"})  # 24 bytes
LIMITS = protocol.Limits(max_control_bytes=100)


def test_messages_are_kept_in_order_as_received() -> None:
    early = EarlyMessages(LIMITS)
    assert not early and not early.full
    stop = json.dumps({"type": "session.stop"})
    early.keep(PING)
    early.keep(stop)
    assert [early.pop(), early.pop()] == [PING, stop]
    assert not early


def test_reading_stops_at_a_number_of_messages() -> None:
    early = EarlyMessages(protocol.Limits(max_control_bytes=1 << 20))
    for _ in range(EARLY_MESSAGES - 1):
        early.keep(PING)
    assert not early.full
    early.keep(PING)
    assert early.full


def test_reading_stops_once_the_bytes_kept_reach_the_control_limit() -> None:
    early = EarlyMessages(LIMITS)
    for _ in range(4):  # 96 bytes
        early.keep(PING)
    assert not early.full
    early.keep(PING)  # the last one read may go past the limit, never twice over it
    assert early.full


def test_text_is_counted_in_utf8_bytes_not_characters() -> None:
    early = EarlyMessages(LIMITS)
    accents = json.dumps({"type": "session.ping", "note": "é" * 30}, ensure_ascii=False)
    early.keep(accents)  # 66 characters, 96 bytes: kept as it is
    assert not early.full
    early.keep(PING)  # 120 bytes kept (in characters, 90)
    assert early.full
    assert early.pop() == accents


def test_a_message_over_the_limit_is_kept_as_its_refusal_without_its_bytes() -> None:
    early = EarlyMessages(LIMITS)
    big = json.dumps({"type": "session.ping", "pad": "x" * 200})
    # 80 characters, but 125 bytes: over the limit too.
    wide = json.dumps({"type": "session.ping", "pad": "é" * 45}, ensure_ascii=False)
    for raw in (big, wide):
        early.keep(raw)
    kept = [early.pop() for _ in range(2)]
    for refusal in kept:
        assert isinstance(refusal, protocol.ProtocolError)
        assert refusal.code is protocol.ErrorCode.MESSAGE_TOO_LARGE
        assert refusal.__traceback__ is None  # nothing keeps the message alive
    early.keep(big)
    assert not early.full  # a refusal holds no bytes: reading goes on


def test_a_binary_message_without_input_video_is_kept_as_its_refusal() -> None:
    """Binary messages are input video frames: in a session without one, only the refusal
    (no bytes), whatever their size or content (JSON in a binary frame included)."""
    early = EarlyMessages(LIMITS)
    for raw in (PING.encode(), bytes(500)):
        early.keep(raw)
        refusal = early.pop()
        assert isinstance(refusal, protocol.ProtocolError)
        assert refusal.code is protocol.ErrorCode.INVALID_MESSAGE
    assert not early.full


def test_an_input_frame_is_kept_up_to_the_frame_cap_not_the_control_limit() -> None:
    early = EarlyMessages(LIMITS, frame_bytes=1000)
    frame = bytes(400)  # four times the control limit, under the frame cap
    early.keep(frame)
    assert early.full  # reading stops: at most the control limit and one frame are held
    early.keep(bytes(1001))  # read before the check: kept as its length only
    assert early.pop() == frame
    assert early.pop() == OversizedFrame(1001)

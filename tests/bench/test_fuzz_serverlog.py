"""The fuzz's log reading (``bench/_fuzz/serverlog.py``): the excerpt keeps a record's own
frames and exception, and two internal errors are told apart by what was logged.
"""

from __future__ import annotations

from bench._fuzz.oracle import Problem
from bench._fuzz.runner import Violation
from bench._fuzz.serverlog import log_causes, log_exceptions, log_excerpt


def test_log_excerpt_keeps_the_records_frames_and_exception() -> None:
    log = "\n".join(
        [
            "2026-01-01 00:00:00,000 INFO trio_vstream.session.session: session r1 started",
            "2026-01-01 00:00:00,001 ERROR trio_vstream.session.session: session r1: internal "
            "error",
            "Traceback (most recent call last):",
            '  File "/x/site-packages/trio/_threads.py", line 1, in run',
            "    noise()",
            '  File "/x/trio_vstream/media/encoding.py", line 214, in __init__',
            "    ctx.time_base = Fraction(1, fps)",
            "    ^^^^^^^^^^^^^",
            "OverflowError: value too large to convert to int",
            "2026-01-01 00:00:00,002 INFO trio_vstream.session.session: session r2 started",
        ]
    )
    excerpt = log_excerpt(log, "r1")
    assert excerpt[0].endswith("session r1 started")
    assert any("encoding.py" in line for line in excerpt)
    assert any("Fraction(1, fps)" in line for line in excerpt)
    assert excerpt[-1].strip() == "OverflowError: value too large to convert to int"
    assert not any("noise" in line or "r2" in line for line in excerpt)
    assert log_exceptions(log) == {"OverflowError: value too large to convert to int": 1}


def test_log_causes_tell_two_internal_errors_apart() -> None:
    log = "\n".join(
        [
            "2026-01-01 00:00:00,001 ERROR x: session video_stream-aa: internal error",
            "  | ExceptionGroup:  (1 sub-exception)",
            "    | Traceback (most recent call last):",
            "    | AttributeError: 'NoneType' object has no attribute 'width'",
            "2026-01-01 00:00:00,002 ERROR x: session video_stream-bb: internal error",
            "Traceback (most recent call last):",
            "OverflowError: value too large to convert to int",
            "2026-01-01 00:00:00,003 INFO trio_vstream.session.session: session video_stream-cc "
            "ended",
        ]
    )
    assert log_causes(log) == {
        "video_stream-aa": "AttributeError",
        "video_stream-bb": "OverflowError",
    }
    violation = Violation("start", Problem("internal-error", "x"), cause="OverflowError")
    assert violation.signature == "start:internal-error[OverflowError]"

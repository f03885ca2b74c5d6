"""The soak's log checks (``bench/_soak/serverlog.py``) over the shared log parser
(``bench/_harness.py``): ERROR records, tracebacks and Python's complaints at exit are
flagged unless the failure was injected (or, in the batched part, a wedge round's, once
per wedge), and the summary counts warnings with ids and numbers blanked.
"""

from __future__ import annotations

from bench._harness import LogRecord, parse_log
from bench._soak.serverlog import WEDGE_ERRORS, log_problems, log_summary, wedge_log_problems

_ID = "video_stream-" + "a" * 32
_OTHER = "video_stream-" + "b" * 32
_SESSION = "trio_vstream.session.session"
"""The session's logger, as a server's log names it."""
LOG = f"""trio_vstream serving ws://127.0.0.1:1/v1/realtime/video (engine: synthetic)
2026-01-01 10:00:00,000 INFO {_SESSION}: session {_ID} started
2026-01-01 10:00:00,100 ERROR {_SESSION}: session {_ID}: engine failed while generating
Traceback (most recent call last):
  File "x.py", line 1, in f
trio_vstream.engines.contract.EngineError: synthetic engine failure at chunk 1 (fail_at_chunk)
2026-01-01 10:00:00,200 ERROR {_SESSION}: session {_OTHER}: internal error
Traceback (most recent call last):
trio_websocket._impl.ConnectionClosed: CloseReason<code=1006>
2026-01-01 10:00:00,300 INFO trio_vstream.server.app: something
Traceback (most recent call last):
ValueError: printed, not logged
2026-01-01 10:00:00,400 WARNING {_SESSION}: session {_ID}: stall timeout for 1.5 s
"""


def test_log_errors_other_than_injected_failures_are_flagged() -> None:
    records = parse_log(LOG)
    assert [r.level for r in records] == ["OTHER", "INFO", "ERROR", "ERROR", "INFO", "WARNING"]
    assert len(records[2].lines) == 4  # the traceback belongs to its record
    bad = log_problems(records, expected_ids={_ID})
    assert [r.lines[0][24:] for r in bad] == [
        f"ERROR trio_vstream.session.session: session {_OTHER}: internal error",
        "INFO trio_vstream.server.app: something",
    ]
    assert len(log_problems(records, expected_ids=set())) == 3
    summary = log_summary(records)
    assert summary["WARNING session <id>: stall timeout for N s"] == 1


def test_errors_and_complaints_at_exit_are_flagged() -> None:
    text = "2026-01-01 10:00:00,000 INFO trio_vstream: SIGTERM: shutting down gracefully\n"
    text += "2026-01-01 10:00:01,000 ERROR trio_vstream.scheduling.batcher: batch failed\n"
    text += "2026-01-01 10:00:01,100 INFO trio_vstream.server.app: x\n"
    text += "Exception ignored in: <function Thread.__del__>\n"
    text += "2026-01-01 10:00:01,200 INFO trio_vstream.server.app: y\n"
    text += "Fatal Python error: _enter_buffered_busy\n"
    bad = log_problems(parse_log(text), expected_ids=set())
    assert [record.lines[-1] for record in bad] == [
        "2026-01-01 10:00:01,000 ERROR trio_vstream.scheduling.batcher: batch failed",
        "Exception ignored in: <function Thread.__del__>",
        "Fatal Python error: _enter_buffered_busy",
    ]


def _wedge_log(*extra: str) -> list[LogRecord]:
    """A batched server's log with one wedge: the batcher's ERROR, the server's, the
    recovery (warnings), and ``extra`` lines."""
    lines = [
        "2026-01-01 10:00:00,000 ERROR trio_vstream.scheduling.batcher: the batched step "
        "_call_batch hangs: "
        "its session was abandoned; rows fail at once until it returns",
        "2026-01-01 10:00:00,001 ERROR trio_vstream.server.app: engine wedged: 1 engine call(s) "
        "stuck "
        "after their sessions ended (_call_batch); /health answers 503",
        "2026-01-01 10:00:02,000 WARNING trio_vstream.scheduling.batcher: the engine's hung step "
        "returned",
        "2026-01-01 10:00:02,001 WARNING trio_vstream.server.app: engine recovered: 0 engine "
        "call(s)",
        *extra,
    ]
    return parse_log("\n".join(lines) + "\n")


def test_a_wedge_rounds_errors_are_expected_once_per_wedge_and_no_others() -> None:
    records = _wedge_log()
    assert log_problems(records, set(), WEDGE_ERRORS) == []
    assert len(log_problems(records, set())) == 2  # without the allowance: both flagged
    assert wedge_log_problems(records, wedges=1) == []
    # Two wedges, but the server said so once; or never.
    missing = wedge_log_problems(records, wedges=2)
    assert len(missing) == 2 and all("expected 2 (one per wedge)" in p for p in missing)
    assert len(wedge_log_problems(parse_log(""), wedges=1)) == 2
    # Any other error is still flagged, and so is an expected one with a traceback.
    other = _wedge_log("2026-01-01 10:00:03,000 ERROR trio_vstream.session.session: internal error")
    assert [r.lines[0][24:] for r in log_problems(other, set(), WEDGE_ERRORS)] == [
        "ERROR trio_vstream.session.session: internal error"
    ]
    traced = parse_log(
        "2026-01-01 10:00:00,000 ERROR trio_vstream.server.app: engine wedged: 1 engine call(s)\n"
        "Traceback (most recent call last):\nValueError: boom\n"
    )
    assert len(log_problems(traced, set(), WEDGE_ERRORS)) == 1

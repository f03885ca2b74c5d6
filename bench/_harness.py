"""What the soak (``bench/soak.py``) and the fuzz (``bench/fuzz.py``) share.

Both start the synthetic engine's server as a subprocess on 127.0.0.1, poll its
``/stats``, read its log afterwards and report progress on stderr. The process, the
endpoint, ``/stats`` and /proc are the benchmark's own (``bench._server``), as are the
progress line (``bench._output``) and the statistics (``bench._stats``); what only the
two harnesses need lives here, once: the synthetic server's command line and its log
taken apart into records.
"""

from __future__ import annotations

import datetime as dt
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import attrs

__all__ = [
    "LOG_RECORD",
    "REQUEST_ID",
    "LogRecord",
    "log_size",
    "parse_log",
    "read_log",
    "synthetic_server_command",
]


def synthetic_server_command(
    engine_args: Sequence[tuple[str, str]],
    *,
    max_sessions: int,
    max_start_bytes: int,
    max_control_bytes: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """``python -m trio_vstream serve`` with the synthetic engine on 127.0.0.1, a port the
    kernel picks (the server prints its URL), and the limits the harness aims at: the
    inputs are sized against these, so they are passed rather than assumed."""
    command = [sys.executable, "-m", "trio_vstream", "serve", "--host", "127.0.0.1"]
    command += ["--port", "0", "--engine", "synthetic"]
    for key, value in engine_args:
        command += ["--engine-arg", f"{key}={value}"]
    command += ["--max-sessions", str(max_sessions)]
    command += ["--max-start-bytes", str(max_start_bytes)]
    command += ["--max-control-bytes", str(max_control_bytes)]
    return command + list(extra)


# --------------------------------------------------------------------------------------
# The server's log (format: "%(asctime)s %(levelname)s %(name)s: %(message)s", cli/serve.py)
# --------------------------------------------------------------------------------------

LOG_RECORD: Final = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (?P<level>[A-Z]+) (?P<name>\S+): "
    r"(?P<message>.*)$"
)
"""The first line of a log record; any other line (a traceback, a print) continues the
record before it."""
REQUEST_ID: Final = re.compile(r"video_stream-[0-9a-f]{32}")


@attrs.frozen
class LogRecord:
    """One record of the server's log, its continuation lines included."""

    wall: float | None
    """Wall-clock time of the record (None for lines before the first record)."""
    level: str
    name: str
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def parse_log(text: str) -> list[LogRecord]:
    """The server's log as records: a line in the logging format starts one, anything
    else (tracebacks, prints) belongs to the record before it."""
    records: list[LogRecord] = []
    wall: float | None = None
    level, name = "OTHER", ""
    lines: list[str] = []
    for line in text.splitlines():
        match = LOG_RECORD.match(line)
        if match:
            if lines:
                records.append(LogRecord(wall, level, name, tuple(lines)))
            stamp = dt.datetime.strptime(match["time"], "%Y-%m-%d %H:%M:%S,%f")
            wall, level, name, lines = stamp.timestamp(), match["level"], match["name"], [line]
        else:
            lines.append(line)
    if lines:
        records.append(LogRecord(wall, level, name, tuple(lines)))
    return records


def read_log(path: Path, offset: int = 0) -> str:
    """The log file from byte ``offset`` on (empty if it cannot be read): the fuzz reads
    what one replayed input made the server log by remembering the size before it."""
    try:
        with path.open("rb") as log:
            log.seek(offset)
            return log.read().decode("utf-8", "replace")
    except OSError:
        return ""


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0

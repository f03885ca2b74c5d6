"""What the harnesses print: timestamped progress on stderr, markdown tables on stdout.

Shared by ``run.py``, ``soak.py`` and ``fuzz.py``, so that their logs line up (one clock,
started when the harness was imported) and their tables look alike.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

now = time.monotonic
"""CLOCK_MONOTONIC, like the server's /stats timestamps: comparable on one Linux host."""

START_TIME = now()


def progress(message: str) -> None:
    """Long runs report on stderr, so that stdout stays the table."""
    print(f"[{now() - START_TIME:7.1f}s] {message}", file=sys.stderr, flush=True)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub-flavoured table: the report is read on GitHub as often as in a terminal."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def read_file(path: str) -> str:
    """A file (often in /proc) as text; empty where it cannot be read, since what is read
    this way only describes the machine and must never end a run."""
    try:
        return Path(path).read_text()
    except OSError:
        return ""

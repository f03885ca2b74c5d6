"""The server side, as the harnesses see it from outside: a started server process, its
``/stats``, and what ``/proc`` tells about a process (threads, page faults, CPU time).

Nothing here speaks the video protocol, so that it serves any harness that measures a
server: the benchmark, the soak and the fuzzer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import attrs
import trio

from bench._output import progress


@attrs.frozen
class Endpoint:
    """A WebSocket URL taken apart; ``/stats`` is plain HTTP on the same port."""

    url: str
    secure: bool
    host: str
    port: int
    resource: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            raise ValueError(f"not a ws:// or wss:// URL: {url!r}")
        secure = parts.scheme == "wss"
        resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return cls(url, secure, parts.hostname, parts.port or (443 if secure else 80), resource)

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port in (80, 443) else f"{host}:{self.port}"

    @property
    def is_local(self) -> bool:
        return self.host in ("localhost", "::1") or self.host.startswith("127.")

    async def open_stream(self) -> trio.SocketStream | trio.SSLStream[trio.SocketStream]:
        if self.secure:
            context = ssl.create_default_context()
            return await trio.open_ssl_over_tcp_stream(
                self.host, self.port, ssl_context=context, https_compatible=True
            )
        return await trio.open_tcp_stream(self.host, self.port)


_URL_PATTERN: Final = re.compile(r"(wss?://[^\s'\"]+)")


class ServerProcess:
    """A server the harness started: its URL, its pid, and a guaranteed end.

    Its stdout and stderr go to a log file, not a pipe, so that a chatty server can never
    block on a full pipe; the URL line is found by reading the file.
    """

    def __init__(
        self, command: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.command = list(command)
        self.log_path = log_path
        self.env = dict(env or {})
        """Set in the server's environment, over the harness's own."""
        self.process: trio.Process | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def start(self, timeout: float) -> str:
        with self.log_path.open("wb") as log:
            self.process = await trio.lowlevel.open_process(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            )
        with trio.move_on_after(timeout):
            while True:
                match = _URL_PATTERN.search(self.log_tail(lines=200))
                if match:
                    return match.group(1)
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"server exited with status {self.process.returncode} before serving:\n"
                        + self.log_tail()
                    )
                await trio.sleep(0.05)
        raise RuntimeError(f"server printed no ws:// URL in {timeout:.0f} s:\n{self.log_tail()}")

    async def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM (the server's graceful shutdown), then SIGKILL after ``grace`` seconds.
        Shielded, so that it also runs while the harness is being cancelled (Ctrl-C)."""
        process = self.process
        if process is None:
            return None
        with trio.CancelScope(shield=True):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                with trio.move_on_after(grace):
                    await process.wait()
            if process.poll() is None:
                progress(f"server {process.pid} ignored SIGTERM for {grace:.0f} s: killing it")
                process.kill()
                await process.wait()
        return process.returncode


async def fetch_stats(endpoint: Endpoint, timeout: float = 5.0) -> dict[str, Any] | None:
    """``GET /stats`` on the WebSocket's port; None where the server has none."""
    with trio.move_on_after(timeout):
        try:
            stream = await endpoint.open_stream()
        except OSError:
            return None
        data = bytearray()
        try:
            request = (
                f"GET /stats HTTP/1.1\r\nHost: {endpoint.host_header}\r\n"
                "Accept: application/json\r\nConnection: close\r\n\r\n"
            )
            await stream.send_all(request.encode())
            while chunk := await stream.receive_some(65536):
                data += chunk
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return None
        finally:
            await stream.aclose()
        head, _, body = bytes(data).partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0].split()
        if len(status) < 2 or status[1] != b"200":
            return None
        try:
            metrics = json.loads(body)
        except ValueError:
            return None
        return metrics if isinstance(metrics, dict) else None
    return None


async def http_get(endpoint: Endpoint, path: str, timeout: float = 5.0) -> tuple[int | None, bytes]:
    """A plain ``GET`` on the server's port; (None, why) when there is no answer."""
    with trio.move_on_after(timeout):
        try:
            stream = await endpoint.open_stream()
        except OSError as exc:
            return None, str(exc).encode()
        data = b""
        try:
            request = (
                f"GET {path} HTTP/1.1\r\nHost: {endpoint.host_header}\r\nConnection: close\r\n\r\n"
            )
            await stream.send_all(request.encode())
            while chunk := await stream.receive_some(65536):
                data += chunk
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await stream.aclose()
        head, _, body = data.partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0].split()
        return (int(status[1]) if len(status) > 1 and status[1].isdigit() else None), body
    return None, b"timed out"


def os_threads(pid: int | None) -> int | None:
    """Native threads of a server the harness started: x264's and OpenBLAS's included,
    which ``threading.active_count()`` in /stats does not see."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def minor_faults(pid: int | str | None) -> int | None:
    """Minor page faults of a process so far, from /proc (fresh memory touched)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[7])
    except (OSError, ValueError, IndexError):
        return None


def cpu_seconds(pid: int | str | None) -> float | None:
    """User + system CPU seconds of a process ("self": the harness), from /proc."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None

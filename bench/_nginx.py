"""nginx in front of servers the harness started, configured by the shipped
``deploy/nginx.conf`` itself: rendered (only addresses, ports and paths swapped), run,
read back (its access log says which backend served each request), and stopped.

Shared by the ``fleet`` scenario and the tests that run nginx
(``tests/server/test_deploy_nginx.py``, ``tests/server/test_deploy_fleet.py``), so that
what they measure and check is what an operator copies. nginx is Debian's
(``apt-get install nginx``); where /usr/sbin/nginx is missing, they skip.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Final
from urllib.parse import parse_qs, urlsplit

import attrs
import trio

from bench._server import Endpoint, http_get
from bench._settings import REPO_DIR

NGINX: Final = Path("/usr/sbin/nginx")
NGINX_CONF: Final = REPO_DIR / "deploy" / "nginx.conf"
SHIPPED_CACHE_DIR: Final = "/var/cache/nginx/trio-vstream"
"""Where the shipped configuration keeps its LL-HLS cache (``proxy_cache_path``)."""
READY_TIMEOUT: Final = 15.0
"""Seconds for nginx to answer ``GET /health`` with 200 through a backend."""

_SERVER_LINE: Final = re.compile(r"^\s*server 127\.0\.0\.1:(\d+) .*\n", flags=re.MULTILINE)
_LOG_LINE: Final = re.compile(
    r'"GET (?P<path>\S+) HTTP/1\.1" (?P<status>\d{3}) \d+ rt=\S+ '
    r"upstream=(?P<upstream>.*) ustatus=(?P<ustatus>.*) urt=.*?"
    r"(?: cache=(?P<cache>\S+))?$"
)


def _replace_once(text: str, old: str, new: str) -> str:
    """Swap a line the caller relies on; loudly, if an edit to the shipped file moved it,
    rather than silently running some other configuration."""
    count = text.count(old)
    if count != 1:
        raise ValueError(f"deploy/nginx.conf: expected {old!r} once, found it {count} times")
    return text.replace(old, new)


def render_nginx_conf(
    shipped: str,
    *,
    listen_port: int,
    backend_ports: Sequence[int],
    prefix: Path,
    backend_hosts: Sequence[str] | None = None,
    fewer_backends: bool = False,
) -> str:
    """deploy/nginx.conf, made runnable by an unprivileged process in a temporary directory.

    Every path nginx would write under /var or /run moves under ``prefix``, the HLS
    cache's directory (``proxy_cache_path``) to ``prefix/hls-cache``. As root, the
    workers run as root too: the shipped ``www-data`` could not enter a private
    temporary directory. ``worker_processes 2`` rather than ``auto`` bounds the cost on a
    big machine, and still has two workers share least_conn's counts through the zone.
    ``backend_hosts``: the backends' addresses, when not all 127.0.0.1 (several hosts).
    The backends replace the shipped ``server`` lines one for one; with
    ``fewer_backends``, fewer backends than lines leave the surplus lines out (one
    server alone is one line, as an operator with one server writes it).
    """
    text = _replace_once(shipped, "user www-data;\n", "user root;\n" if os.geteuid() == 0 else "\n")
    text = _replace_once(text, "worker_processes auto;", "worker_processes 2;")
    text = _replace_once(text, "pid /run/nginx.pid;", f"pid {prefix}/nginx.pid;")
    text = _replace_once(
        text, "error_log /var/log/nginx/error.log;", f"error_log {prefix}/error.log warn;"
    )
    text = _replace_once(
        text,
        "access_log /var/log/nginx/trio-vstream.access.log trio_vstream;",
        f"access_log {prefix}/access.log trio_vstream;",
    )
    text = _replace_once(text, "listen 80;", f"listen 127.0.0.1:{listen_port};")
    text = _replace_once(
        text, f"proxy_cache_path {SHIPPED_CACHE_DIR} ", f"proxy_cache_path {prefix}/hls-cache "
    )
    # Each upstream block (the sessions', the watch links') lists the same servers.
    upstreams = len(re.findall(r"^\s*upstream \S+ \{$", text, flags=re.MULTILINE))
    lines = list(_SERVER_LINE.finditer(text))
    shipped_ports = list(dict.fromkeys(line[1] for line in lines))
    for shipped_port in shipped_ports:
        count = sum(line[1] == shipped_port for line in lines)
        if count != upstreams:
            raise ValueError(
                f"deploy/nginx.conf lists 127.0.0.1:{shipped_port} {count} times, expected "
                f"once in each of its {upstreams} upstream blocks"
            )
    if not backend_ports or len(backend_ports) > len(shipped_ports):
        raise ValueError(
            f"deploy/nginx.conf lists {len(shipped_ports)} backends, asked for {len(backend_ports)}"
        )
    if len(backend_ports) < len(shipped_ports) and not fewer_backends:
        raise ValueError(
            f"deploy/nginx.conf lists backends on {shipped_ports}, asked for {len(backend_ports)}"
        )
    hosts = backend_hosts or ["127.0.0.1"] * len(backend_ports)
    for line in lines:
        if line[1] in shipped_ports[len(backend_ports) :]:
            text = text.replace(line[0], "", 1)
    for shipped_port, host, port in zip(shipped_ports, hosts, backend_ports, strict=False):
        text = text.replace(f"server 127.0.0.1:{shipped_port} ", f"server {host}:{port} ")
    temp_paths = "".join(
        f"    {kind}_temp_path {prefix}/{kind}_temp;\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return _replace_once(text, "\nhttp {\n", f"\nhttp {{\n{temp_paths}")


def nginx_command(conf: Path, prefix: Path, *extra: str) -> list[str]:
    """``-e``: the error log nginx uses before it has read the configuration (Debian's
    default, /var/log/nginx/error.log, is not writable without root)."""
    return [
        str(NGINX),
        "-p",
        f"{prefix}/",
        "-c",
        str(conf),
        "-e",
        str(prefix / "startup-error.log"),
        *extra,
    ]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now on ``host``. Another process may take it
    before it is bound; `running_nginx` then tries again with another."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


@attrs.frozen
class LogEntry:
    """One request in nginx's access log, in the shipped ``trio_vstream`` format."""

    path: str
    status: int
    upstreams: tuple[str, ...]
    """Every backend nginx tried, in order; the last one answered."""
    upstream_statuses: tuple[str, ...]
    cache: str = "-"
    """What the HLS cache did (``HIT``, ``MISS``, ``BYPASS``, ...); ``-`` outside it."""

    @property
    def served_by(self) -> str:
        return self.upstreams[-1]

    @property
    def reached_a_backend(self) -> bool:
        """Whether a backend was asked (nginx writes ``upstream=-`` for a request the cache
        answered, a waiter on the cache lock's included)."""
        return self.upstreams != ("-",)


def _entry(match: re.Match[str]) -> LogEntry:
    return LogEntry(
        path=match["path"],
        status=int(match["status"]),
        upstreams=tuple(match["upstream"].split(", ")),
        upstream_statuses=tuple(match["ustatus"].split(", ")),
        cache=match["cache"] or "-",
    )


def read_requests(path: Path) -> list[LogEntry]:
    """Every GET logged so far, in the order nginx wrote them (when each ended)."""
    if not path.exists():
        return []
    return [
        _entry(match)
        for line in path.read_text().splitlines()
        if (match := _LOG_LINE.search(line)) is not None
    ]


def read_access_log(path: Path, key: str) -> dict[str, LogEntry]:
    """The requests logged so far whose query names them with ``key`` (``?session=NAME``:
    the server ignores the query, nginx's log shows it), by name. nginx writes a
    WebSocket request's line when its connection closes."""
    entries: dict[str, LogEntry] = {}
    if not path.exists():
        return entries
    for line in path.read_text().splitlines():
        match = _LOG_LINE.search(line)
        if match is None:
            continue
        names = parse_qs(urlsplit(match["path"]).query).get(key)
        if not names:
            continue
        entries[names[0]] = _entry(match)
    return entries


@attrs.define
class Nginx:
    """A running nginx: where it listens and where its files are."""

    process: trio.Process
    port: int
    prefix: Path

    @property
    def access_log_path(self) -> Path:
        return self.prefix / "access.log"

    def url(self, path: str) -> str:
        return f"ws://127.0.0.1:{self.port}{path}"

    def error_log(self) -> str:
        path = self.prefix / "error.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


async def nginx_ready(nginx: trio.Process, port: int, timeout: float = READY_TIMEOUT) -> bool:
    """True once GET /health through nginx answers 200 (nginx listens and reaches a
    backend); False if nginx exited first (the port was taken, say)."""
    endpoint = Endpoint.parse(f"ws://127.0.0.1:{port}/")
    with trio.fail_after(timeout):
        while nginx.poll() is None:
            status, _ = await http_get(endpoint, "/health")
            if status == 200:
                return True
            await trio.sleep(0.05)
    return False


@contextlib.asynccontextmanager
async def running_nginx(
    directory: Path,
    backends: Sequence[tuple[str, int]],
    *,
    fewer_backends: bool = False,
) -> AsyncIterator[Nginx]:
    """nginx rendered from the shipped configuration in front of ``backends`` (host,
    port), listening on a free port of 127.0.0.1, under ``directory``; stopped (SIGTERM,
    its fast shutdown, then SIGKILL) however the body ends. A listen port taken between
    choosing and binding it is chosen again, up to three times."""
    process: trio.Process | None = None
    try:
        for attempt in range(3):
            prefix = directory / f"nginx-{attempt}"
            prefix.mkdir(parents=True)
            port = free_port()
            conf = prefix / "nginx.conf"
            conf.write_text(
                render_nginx_conf(
                    NGINX_CONF.read_text(),
                    listen_port=port,
                    backend_ports=[p for _, p in backends],
                    backend_hosts=[h for h, _ in backends],
                    prefix=prefix,
                    fewer_backends=fewer_backends,
                )
            )
            with (prefix / "nginx.out").open("wb") as out:
                process = await trio.lowlevel.open_process(
                    nginx_command(conf, prefix, "-g", "daemon off;"),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                )
            nginx = Nginx(process, port, prefix)
            if await nginx_ready(process, port):
                break
            if "Address already in use" not in nginx.error_log():
                raise RuntimeError(f"nginx did not start:\n{nginx.error_log()}")
        else:
            raise RuntimeError("nginx found no free port in three tries")
        yield nginx
    finally:
        with trio.CancelScope(shield=True):
            if process is not None and process.returncode is None:
                process.terminate()
                with trio.move_on_after(10):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()

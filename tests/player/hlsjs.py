"""hls.js, a real HLS player, for the tests and the bench: the pinned release from the npm
registry, and the test page (``tests/player/hls/``) that plays an HLS URL with it.

Neither is part of the package (the player page plays the WebSocket stream itself, with
MSE). hls.js comes from the registry's tarball, never from npm at test time: downloaded
once, checked against the registry's published ``dist.integrity`` (a SHA-512 pinned here
beside the version, so that a changed tarball fails rather than runs), and kept under
``~/.cache/trio_vstream-tests/`` (``$XDG_CACHE_HOME`` if set), where it is checked again
on every use. To move to another release, change both pins::

    curl -s https://registry.npmjs.org/hls.js/VERSION | python3 -c \\
        'import json, sys; print(json.load(sys.stdin)["dist"]["integrity"])'

The page is served by `route_page` through Playwright at a path of the origin that the
HLS URL is on (the server's, or nginx's in front of it), so hls.js's requests are
same-origin: the server sends no CORS headers, and needs none for this.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import tarfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from playwright.sync_api import Page, Route

HLSJS_VERSION: Final = "1.6.15"
"""The last 1.6 release, not the latest (1.7.4): 1.7.4 started at a live playlist's
first segment (``startPosition: 0``, low-latency mode) reloads that segment's last part
for ever instead of moving on to the next segment, with or without sound; 1.6.15 plays
the same stream to its end (`tests/player/test_player_hls.py` fails on 1.7.4)."""
HLSJS_INTEGRITY: Final = "sha512-E3a5VwgXimGHwpRGV+WxRTKeSp2DW5DI5MWv34ulL3t5UNmyJWCQ1KmLEHbYzcfThfXG8amBL+fCYPneGHC4VA=="  # noqa: E501 (the hash, whole)
"""The registry's ``dist.integrity`` of the release above (checked on 2026-12-07)."""
HLSJS_TARBALL: Final = f"https://registry.npmjs.org/hls.js/-/hls.js-{HLSJS_VERSION}.tgz"
HLSJS_MEMBER: Final = "package/dist/hls.min.js"
"""The full build, the one most sites ship (the light one leaves out subtitles, alternate
audio and DRM, none of which these streams use)."""
PAGE_DIR: Final = Path(__file__).resolve().parent / "hls"
PAGE_PREFIX: Final = "/__hlsjs__/"
"""Where `route_page` serves the page on the stream's origin (the server never sees it)."""
DOWNLOAD_TIMEOUT_S: Final = 60.0

_CONTENT_TYPES: Final = {".html": "text/html", ".js": "text/javascript"}


class HlsJsUnavailable(RuntimeError):
    """The tarball could not be downloaded (no network, say): a test skips, or fails in CI."""


class HlsJsMismatch(RuntimeError):
    """The tarball is not the one pinned: always a failure, never a skip."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trio_vstream-tests"


def _integrity(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


def _download(url: str, timeout: float) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data: bytes = response.read()
            return data
    except (urllib.error.URLError, OSError) as exc:
        raise HlsJsUnavailable(f"cannot download {url}: {exc}") from exc


def hlsjs_script(directory: Path | None = None, timeout: float = DOWNLOAD_TIMEOUT_S) -> bytes:
    """``hls.min.js`` of the pinned release: from the cached tarball, or downloaded into
    the cache first; the tarball checked against `HLSJS_INTEGRITY` either way."""
    directory = directory or cache_dir()
    tarball = directory / f"hls.js-{HLSJS_VERSION}.tgz"
    data = tarball.read_bytes() if tarball.exists() else None
    if data is None or _integrity(data) != HLSJS_INTEGRITY:
        # A missing or damaged cached copy (an interrupted write, say) is fetched again.
        data = _download(HLSJS_TARBALL, timeout)
        found = _integrity(data)
        if found != HLSJS_INTEGRITY:
            raise HlsJsMismatch(
                f"{HLSJS_TARBALL}: integrity {found}, pinned {HLSJS_INTEGRITY}: the registry "
                "served other bytes than the release pinned in tests/player/hlsjs.py"
            )
        directory.mkdir(parents=True, exist_ok=True)
        partial = tarball.with_name(f"{tarball.name}.{os.getpid()}.part")
        partial.write_bytes(data)
        partial.replace(tarball)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        member = archive.extractfile(HLSJS_MEMBER)
        if member is None:
            raise HlsJsMismatch(f"{HLSJS_TARBALL} has no {HLSJS_MEMBER}")
        return member.read()


def route_page(page: Page, origin: str, script: bytes) -> str:
    """Serve the test page and ``script`` (hls.js) to ``page`` at `PAGE_PREFIX` of
    ``origin`` (``http://host:port``), answered by Playwright; returns the page's URL."""
    files = {
        "index.html": (PAGE_DIR / "index.html").read_bytes(),
        "page.js": (PAGE_DIR / "page.js").read_bytes(),
        "hls.min.js": script,
    }

    def fulfil(route: Route) -> None:
        name = route.request.url.removeprefix(f"{origin}{PAGE_PREFIX}").split("?")[0]
        body = files.get(name)
        if body is None:
            route.fulfill(status=404, body=b"not found")
            return
        content_type = _CONTENT_TYPES[Path(name).suffix]
        route.fulfill(status=200, body=body, headers={"Content-Type": content_type})

    page.route(f"{origin}{PAGE_PREFIX}**", fulfil)
    return f"{origin}{PAGE_PREFIX}index.html"

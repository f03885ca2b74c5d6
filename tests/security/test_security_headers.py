"""Every plain-HTTP response carries the security headers, and the page works under them.

Without them another site could frame the player and click its buttons for the user
(clickjacking), a browser could sniff a JSON or text body into HTML, the watch token in
a share link's URL could leave in a Referer, and a script injected into the page could
load more code or send what it reads anywhere. The CSP is only worth having if the page
runs under it without a single violation: checked in Debian's chromium.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import ConsoleMessage

from tests.player.test_player import CHROMIUM, WAIT_MS, launch_chromium, serve, start, wait_playing
from tests.security.raw_http import UPGRADE_HEADERS, request, upgrade
from trio_vstream.server.access import AccessPolicy, key_subprotocol
from trio_vstream.server.http import CONTENT_SECURITY_POLICY, SECURITY_HEADERS

KEY = "headers-key_0123456789"


def assert_secured(response: Any, what: str) -> None:
    for name, value in SECURITY_HEADERS.items():
        assert response.headers.get(name) == value, (what, name, response.headers)


def test_the_policy_says_what_the_issue_asks() -> None:
    directives = dict(d.split(" ", 1) for d in CONTENT_SECURITY_POLICY.split("; "))
    assert directives["default-src"] == "'none'"
    assert directives["frame-ancestors"] == "'none'"
    assert directives["script-src"] == "'self'" and directives["style-src"] == "'self'"
    assert directives["connect-src"] == "'self'"  # no ws: or wss: to anywhere
    assert "blob:" in directives["media-src"]
    assert "unsafe" not in CONTENT_SECURITY_POLICY
    assert SECURITY_HEADERS["x-content-type-options"] == "nosniff"
    assert SECURITY_HEADERS["x-frame-options"] == "DENY"
    assert SECURITY_HEADERS["referrer-policy"] == "no-referrer"


async def test_every_http_response_carries_the_headers(start_server: Any) -> None:
    running = await start_server(access=AccessPolicy(api_keys=(KEY,)))
    port = running.server.port
    host = [("Host", f"127.0.0.1:{port}")]
    keyed = [*host, ("Authorization", f"Bearer {KEY}")]
    for path, headers, status in [
        ("/", host, 200),
        ("/static/player.js", host, 200),
        ("/static/player.css", host, 200),
        ("/static/missing.js", host, 404),
        ("/health", host, 200),
        ("/v1/models", keyed, 200),
        ("/metrics", keyed, 200),
        ("/stats", keyed, 403),
        ("/stats", host, 401),
        ("/v1/realtime/video", keyed, 426),
        ("/nowhere", keyed, 404),
        ("/health", [("Host", "attacker.example")], 421),
    ]:
        response = await request(port, path, headers)
        assert response.status == status, (path, response)
        assert_secured(response, f"{status} {path}")
    assert_secured(await request(port, "/health", host, method="POST"), "405")
    too_many = [
        *host,
        ("Sec-WebSocket-Protocol", f"{key_subprotocol('a')}, {key_subprotocol('b')}"),
    ]
    refused = await upgrade(port, too_many)
    assert refused.status == 400
    assert_secured(refused, "400 upgrade")


async def test_refused_upgrades_carry_the_headers(start_server: Any) -> None:
    """Upgrades the server refuses after reading their head: to a path with no WebSocket
    endpoint, and handshakes that are not RFC 6455's (no key, a key that is not 16 bytes
    of base64, another version, no ``Connection: Upgrade``). Each used to be answered by
    trio-websocket or wsproto, without the headers; each is now answered here, with them,
    before the connection is handed over."""
    running = await start_server()
    port = running.server.port
    host = [("Host", f"127.0.0.1:{port}")]
    refused = await upgrade(port, host, path="/nowhere")
    assert refused.status == 404
    assert_secured(refused, "404 upgrade")
    good = dict(UPGRADE_HEADERS)
    for broken, status in [
        ({"Sec-WebSocket-Key": None}, 400),
        ({"Sec-WebSocket-Key": "c2hvcnQ="}, 400),
        ({"Sec-WebSocket-Key": "not base64 at all!!!!!!="}, 400),
        ({"Sec-WebSocket-Version": "8"}, 426),
        ({"Connection": "keep-alive"}, 400),
    ]:
        fields = {**good, **broken}
        headers = [*host, *((n, v) for n, v in fields.items() if v is not None)]
        response = await request(port, "/v1/realtime/video", headers)
        assert response.status == status, (broken, response)
        assert_secured(response, f"{status} upgrade {broken}")
        if status == 426:  # RFC 6455 4.4: say which version is spoken
            assert response.headers["sec-websocket-version"] == "13"
    # The control: the same head, unbroken, is upgraded.
    assert (await upgrade(port, host)).status == 101


async def test_malformed_requests_are_answered_with_the_headers_too(start_server: Any) -> None:
    running = await start_server()
    port = running.server.port
    response = await request(port, "/ not-http", [("Host", "127.0.0.1")], version="XX")
    assert response.status == 400
    assert_secured(response, "400 malformed")


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
@pytest.mark.timeout(120)
def test_the_player_runs_without_a_single_csp_violation(tmp_path: Path) -> None:
    """Load the page, play a video to its end (fetch, WebSocket, MediaSource from a blob:
    URL), and listen for violations the whole time; then check the listener would have
    heard one, by breaking the policy on purpose (eval)."""
    violations: list[str] = []
    with serve(tmp_path / "server.log") as url, launch_chromium() as browser:
        context = browser.new_context()
        context.add_init_script(
            """
            window.__violations = [];
            document.addEventListener("securitypolicyviolation", (e) => {
                window.__violations.push(`${e.violatedDirective} ${e.blockedURI}`);
            });
            """
        )
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)

        def on_console(message: ConsoleMessage) -> None:
            if "Content Security Policy" in message.text or "Content-Security-Policy" in (
                message.text
            ):
                violations.append(message.text)

        page.on("console", on_console)
        response = page.goto(f"{url}/")
        assert response is not None
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        page.wait_for_function("() => document.body.dataset.ready === 'true'")
        start(page, seconds=1)
        wait_playing(page, 0.5)
        page.wait_for_function(
            "() => document.getElementById('status').textContent.includes('session.done')"
        )
        violations += page.evaluate("window.__violations")
        assert violations == [], violations

        # The control: the policy is in force (an injected inline script does not run;
        # Playwright's own evaluate is exempt) and the listener hears the breach.
        ran = page.evaluate(
            """() => {
                const script = document.createElement("script");
                script.textContent = "window.__injected = true";
                document.head.append(script);
                return window.__injected === true;
            }"""
        )
        assert ran is False
        page.wait_for_function("() => window.__violations.length > 0")
        assert "script-src" in page.evaluate("window.__violations")[0]
        context.close()

"""Attacks through ``image_reference`` https URLs (issue 20, item 8): the port.

An operator who allows ``images.example.org`` allows its images, not every service that
host runs: an admin page on :8080, a debug server on :9000. So a URL may name only port
443 of a listed host, unless ``--allow-image-urls`` lists the host with another port
(``images.example.org:8443``, and then that port only), and every redirect hop is held
to the same rule, scheme, host and port alike.

The harness is tests/media/test_image_fetch.py's: real HTTPS servers on 127.0.0.1 (each on its
own port, a stand-in for two services of one host), reached through the fetcher's
test-only resolver, address policy and certificate authority.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trustme

from tests.media.test_image_fetch import (
    PNG,
    ImageHost,
    Reply,
    allow_loopback,
    authority,  # noqa: F401 - the module's certificate authority fixture
    image_host,  # noqa: F401 - the image host fixture
    loopback_resolver,
    refusal,
    serve_image_host,
    trusting,
)
from trio_vstream.media.image_fetch import ImageFetchConfig, allowed_authority, fetch_image
from trio_vstream.protocol import ImageURL


def listing(ca: trustme.CA, *entries: str, **changes: Any) -> ImageFetchConfig:
    """A fetcher allowed exactly these ``--allow-image-urls`` entries (test injection
    points set, so that it can reach the hosts on 127.0.0.1)."""
    return ImageFetchConfig(
        allowed_hosts=frozenset(entries),
        ssl_context=trusting(ca),
        address_policy=allow_loopback,
        resolver=loopback_resolver,
        **changes,
    )


async def test_a_listed_host_is_fetched_on_443_only(
    image_host: ImageHost,  # noqa: F811
    authority: trustme.CA,  # noqa: F811
) -> None:
    """Listed without a port: a URL naming another port of it is refused unconnected."""
    image_host.routes["/admin"] = Reply()
    url = ImageURL.parse(image_host.url("/admin"))
    message = await refusal(fetch_image(url, listing(authority, "images.test")))
    assert message.endswith(
        f": its port {image_host.port} on 'images.test' is not one this server fetches "
        f"from (443 unless --allow-image-urls names the port, like "
        f"images.test:{image_host.port})"
    )
    assert image_host.connections == 0


async def test_a_port_given_in_the_list_is_the_only_one(
    image_host: ImageHost,  # noqa: F811
    authority: trustme.CA,  # noqa: F811
) -> None:
    image_host.routes["/cat.png"] = Reply()
    config = listing(authority, f"images.test:{image_host.port}")
    with trio.fail_after(10):
        image = await fetch_image(ImageURL.parse(image_host.url("/cat.png")), config)
    assert image.data == PNG
    # Listing :PORT does not also allow 443 (nothing is connected to: no attempt at all).
    default_port = ImageURL.parse("https://images.test/cat.png")
    message = await refusal(fetch_image(default_port, config))
    assert ": its port 443 on 'images.test' is not one this server fetches from" in message


async def test_a_redirect_to_another_port_of_the_same_host_is_not_followed(
    nursery: trio.Nursery,
    image_host: ImageHost,  # noqa: F811
    authority: trustme.CA,  # noqa: F811
) -> None:
    other = await serve_image_host(nursery, authority)  # another service, same host
    other.routes["/secret.png"] = Reply()
    target = other.url("/secret.png")
    image_host.routes["/moved"] = Reply(302, [("Location", target)], b"")
    config = listing(authority, f"images.test:{image_host.port}")
    message = await refusal(fetch_image(ImageURL.parse(image_host.url("/moved")), config))
    assert message.endswith(
        f": it redirects to {target!r}, whose port {other.port} on 'images.test' is not "
        f"one this server fetches from (443 unless --allow-image-urls names the port, "
        f"like images.test:{other.port})"
    )
    assert other.connections == 0
    # Listed too, the same redirect is followed: the rule is the list, hop by hop.
    both = listing(authority, f"images.test:{image_host.port}", f"images.test:{other.port}")
    with trio.fail_after(10):
        image = await fetch_image(ImageURL.parse(image_host.url("/moved")), both)
    assert image.data == PNG and other.connections == 1


@pytest.mark.parametrize(
    "location",
    [
        "http://images.test:{port}/cat.png",  # same host and port, plain http
        "https://other.test:{port}/cat.png",  # the port listed, but for another host
        "https://images.test:{port}@other.test/cat.png",  # credentials: refused outright
    ],
)
async def test_every_hop_is_held_to_scheme_host_and_port(
    image_host: ImageHost,  # noqa: F811
    authority: trustme.CA,  # noqa: F811
    location: str,
) -> None:
    image_host.routes["/moved"] = Reply(302, [("Location", location.format(port=image_host.port))])
    image_host.routes["/cat.png"] = Reply()
    config = listing(authority, f"images.test:{image_host.port}")
    message = await refusal(fetch_image(ImageURL.parse(image_host.url("/moved")), config))
    assert ": it redirects to " in message
    assert image_host.requests == [(f"images.test:{image_host.port}", "/moved")]


async def test_a_session_is_refused_another_port(
    start_server: Callable[..., Awaitable[Any]],
    image_host: ImageHost,  # noqa: F811
    authority: trustme.CA,  # noqa: F811
) -> None:
    image_host.routes["/cat.png"] = Reply()
    running = await start_server(image_urls=listing(authority, "images.test"))
    start = {
        "type": "session.start",
        "prompt": "a red circle",
        "size": "64x48",
        "num_frames": 2,
        "image_reference": {"image_url": image_host.url("/cat.png")},
    }
    with trio.fail_after(20):
        transcript = await running.run_session(start)
    assert transcript.types == ["error"]
    assert transcript.messages[0]["code"] == "invalid_request"
    assert (
        f"its port {image_host.port} on 'images.test' is not one"
        in (transcript.messages[0]["message"])
    )
    assert image_host.connections == 0 and running.engine.streams == []


@pytest.mark.parametrize(
    ("entry", "allows"),
    [
        ("images.example.org", "images.example.org"),
        ("Images.Example.org.:443", "images.example.org"),
        ("images.example.org:8443", "images.example.org:8443"),
        ("2001:db8::1", "[2001:db8::1]"),
        ("[2001:db8::1]:8443", "[2001:db8::1]:8443"),
        ("192.0.2.7:8443", "192.0.2.7:8443"),
    ],
)
def test_list_entries_name_a_host_and_a_port(entry: str, allows: str) -> None:
    assert allowed_authority(entry) == allows
    assert ImageFetchConfig(allowed_hosts={entry}).allowed_hosts == {allows}


@pytest.mark.parametrize(
    "entry",
    [
        "https://images.example.org",
        "images.example.org:0",
        "images.example.org:99999",
        "images.example.org:",
        "*.example.org",
        "images.example.org/x",
        "a@b",
        "",
    ],
)
def test_list_entries_that_are_not_a_host_and_port_are_refused(entry: str) -> None:
    with pytest.raises(ValueError, match=r"is not a host name like images\.example\.org"):
        allowed_authority(entry)

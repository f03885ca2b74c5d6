"""``serve``'s flags into what the server is given: keys, TLS, image URLs, the wedge exit.

Each function reads the parsed flags (and, for keys and supervisors, the environment)
and returns a value of the server's, or raises ``ValueError`` with what is wrong, which
the command line prints before anything is loaded or bound. Apart from the flags'
definitions (``serve_flags``) because these are the rules a reader checks (a key is
never echoed, an admin key is not also an API key, an allowed host is a bare name),
and apart from the running server (``serve``) because they decide before it starts.
"""

from __future__ import annotations

import argparse
import os
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trio_vstream import logsafe
from trio_vstream.media import image_fetch
from trio_vstream.server import access

if TYPE_CHECKING:
    pass

__all__ = [
    "ADMIN_API_KEY_ENV",
    "API_KEY_ENV",
    "SUPERVISOR_ENV",
    "access_policy",
    "exit_when_wedged",
    "image_url_config",
    "read_key_file",
    "tls_context",
]

API_KEY_ENV = "TRIO_VSTREAM_API_KEY"
ADMIN_API_KEY_ENV = "TRIO_VSTREAM_ADMIN_API_KEY"
SUPERVISOR_ENV = ("INVOCATION_ID", "KUBERNETES_SERVICE_HOST")
"""Set by systemd for the processes of a unit, and by Kubernetes in every container:
under either, ``--exit-when-wedged`` is on unless ``--no-exit-when-wedged`` says not."""

logger = logsafe.get_logger("trio_vstream")


def access_policy(args: argparse.Namespace) -> access.AccessPolicy:
    """Keys from the flags, the key files and the environment; origins and hosts from the
    flags. Warns about short keys, naming where each is from (never the key itself).
    Raises ``ValueError`` naming what is wrong (never the key itself)."""
    keys = _keys(args.api_keys, API_KEY_ENV, args.api_key_file, "--api-key")
    admin = _keys(
        args.admin_api_keys, ADMIN_API_KEY_ENV, args.admin_api_key_file, "--admin-api-key"
    )
    for source, key in keys + admin:
        if not key or any(c.isspace() for c in key):
            raise ValueError(f"{source}: a key must be non-empty and without spaces")
        if len(key) < access.SHORT_KEY:
            logger.warning(
                "%s: a key shorter than %d characters can be guessed; use a long random one "
                "(python -c 'import secrets; print(secrets.token_urlsafe(32))')",
                source,
                access.SHORT_KEY,
            )
    if {key for _, key in keys} & {key for _, key in admin}:
        raise ValueError("--admin-api-key: an admin key must not also be given as an API key")
    origins = [o.strip() for group in args.allowed_origins for o in group.split(",") if o.strip()]
    for origin in origins:
        if origin != "*" and access.normalise_origin(origin) is None:
            raise ValueError(
                f"--allowed-origins: {origin!r} is not an origin like https://example.org"
            )
    hosts = [h.strip() for group in args.allowed_hosts for h in group.split(",") if h.strip()]
    return access.AccessPolicy(
        api_keys=tuple(dict.fromkeys(key for _, key in keys)),
        admin_keys=tuple(dict.fromkeys(key for _, key in admin)),
        allowed_origins=tuple(origins),
        allowed_hosts=access.normalise_allowed_hosts(hosts),
    )


def _keys(flags: Sequence[str], env: str, path: Path | None, flag: str) -> list[tuple[str, str]]:
    """One kind of key (API or admin) from its flags, its environment variable and its
    file, each with where it came from for messages: ``--api-key 2``, ``$ENV``,
    ``--api-key-file PATH line 3``."""
    keys = [(f"{flag} {n}", key.strip()) for n, key in enumerate(flags, 1)]
    if os.environ.get(env, "").strip():
        keys.append((f"${env}", os.environ[env].strip()))
    if path is not None:
        keys += read_key_file(path, f"{flag}-file")
    return keys


def read_key_file(path: Path, flag: str = "--api-key-file") -> list[tuple[str, str]]:
    """The keys in a key file, one a line, each with its line for messages. Blank lines
    and comments are skipped, indented ones too (``   #old-revoked-key`` is a revoked key
    commented out, not a key). Raises ``ValueError`` if it cannot be read or holds none."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"{flag}: {exc.strerror}: {path}") from None
    keys = [
        (f"{flag} {path} line {n}", line.strip())
        for n, line in enumerate(lines, 1)
        if line.strip() and not line.strip().startswith("#")
    ]
    if not keys:
        raise ValueError(f"{flag}: no key in {path}")
    return keys


def image_url_config(args: argparse.Namespace) -> image_fetch.ImageFetchConfig:
    """What ``--allow-image-urls`` and its limits ask for; raises ``ValueError`` on an
    entry that is not a bare host name or address, with an optional ``:PORT`` (see
    `image_fetch.allowed_authority`: a scheme, path or wildcard would never match a
    URL, and the operator would wonder why nothing is fetched)."""
    hosts: list[str] = []
    for entry in args.image_url_hosts:
        for host in filter(None, (part.strip() for part in entry.split(","))):
            try:
                hosts.append(image_fetch.allowed_authority(host))
            except ValueError as exc:
                raise ValueError(f"--allow-image-urls: {exc}") from None
    return image_fetch.ImageFetchConfig(
        allowed_hosts=frozenset(hosts),
        max_bytes=args.image_url_max_bytes,
        timeout=args.image_url_timeout,
        max_redirects=args.image_url_max_redirects,
    )


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    if args.ssl_certfile is None:
        if args.ssl_keyfile is not None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile")
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--ssl-certfile/--ssl-keyfile: cannot load: {exc}") from None
    return context


def exit_when_wedged(flag: bool | None) -> bool:
    """``--exit-when-wedged``: as given, else on under a supervisor (`SUPERVISOR_ENV`)."""
    if flag is not None:
        return flag
    return any(os.environ.get(name) for name in SUPERVISOR_ENV)

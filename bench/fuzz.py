#!/usr/bin/env python3
"""Hypothesis fuzz of the ``/v1/realtime/video`` protocol, against a real server process.

Why: the protocol's unit tests check the inputs someone thought of. This sends thousands
nobody did (wrong types in every field, huge and NaN-ish numbers, lone surrogates written
as ``\\udc80`` escapes, control characters, deep nesting, broken JSON, binary frames,
messages just under and just over the size limits) to a server started the way users
start it (``python -m trio_vstream --engine synthetic``, in a subprocess, on 127.0.0.1),
and checks what any correct server must do whatever it is sent:

* ``session.start`` (one fresh connection per input, since a rejected start ends the
  connection): the first reply is ``video.start`` or an ``error`` whose ``code`` is one of
  `protocol.ErrorCode`'s values, never ``internal_error``. An accepted session is
  stopped after its first chunk and must end with one terminal message, and not with
  ``generation_failed`` or ``encoding_failed`` unless it asked the synthetic engine for
  a fault: what the server accepts it must be able to generate. Every connection ends
  with a normal close (1000). A message over ``--max-start-bytes`` gets ``message_too_large``
  (or, beyond twice the limit, trio-websocket's documented 1009 close), one within it
  never does.
* control messages, sent one after another into a long-running session, each followed
  by a ``session.ping``: the input gets exactly one reply (``session.pong``,
  ``session.interaction.queued`` or an ``error`` with a per-message code), the ping its
  pong, and the session survives. Only a valid ``session.stop`` may end it; a session
  that ends with ``generation_failed`` (or any other error) after a control message is
  a violation, blamed on the interactions queued but not yet applied, each of which is
  then replayed alone in a fresh session to find the one that does it.
* video in: the control sessions follow an input video in turn (JPEG, PNG, none, WebP,
  a new session every 250 inputs), so every binary control input is an input frame:
  pictures of the session's size in each format (valid, padded to just within the 1 MiB
  cap, over it, other sizes, cut short, corrupted) and garbage, beside ``input_video.end``.
  A frame gets no reply of its own, only the ping its pong; a valid one of the session's
  format is never refused (``invalid_input_frame``), one of another format or size, cut
  short or garbage is refused before the ping is answered, one over the cap gets
  ``message_too_large``; a refusal the decoder sends later names a frame that was sent,
  refused once, that no chunk was made from; the chunks' ``input_frames`` never count
  more frames used or dropped than were sent. In a session without input video a binary
  message gets ``invalid_message``. Starts carry ``input_video`` too (valid and invalid
  fields, the ``v2v_strength`` alias); an accepted one is sent ``input_video.end`` at once.
* every string in every server message encodes as UTF-8 (no lone surrogates after
  ``json.loads``), and every message is strict JSON with a ``type``;
* the server process stays up and answers ``GET /health`` (checked every
  `HEALTH_EVERY` inputs and at the end); afterwards ``/stats`` is back to no session,
  no engine stream and no worker thread, and SIGTERM ends it with status 0.

Hypothesis generates all inputs up front (the same ``--inputs`` and ``--seed``, the same
inputs): the strategies build JSON from the protocol's real field names with values that
are mostly valid and often not, because an input that fails the first check tests only
that check. Then Trio sends
them: start inputs over a few concurrent connections, control inputs in order. Each kind
of violation found is then shrunk to a small input that still shows it (greedy, on the
JSON value; Hypothesis' own shrinker would need the server inside the Hypothesis test).

    python bench/fuzz.py --inputs 2000 --seed 1 --json fuzz.json     # the CI form
    python bench/fuzz.py --inputs 10000 --seed 7                     # the long form

Exit status: 0 no violation; 1 violations (the summary shows each with its minimal
input); 2 usage error; 3 the run could not finish (server did not start, time limit).

This file is only the entry point that ``python bench/fuzz.py`` runs; the code is in
``bench/_fuzz/`` (one module per concern, listed in its docstring). The package is not
called ``bench/fuzz/`` because a package and a module of the same name side by side
would make ``import bench.fuzz`` ambiguous.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._fuzz.cli import main

if __name__ == "__main__":
    sys.exit(main())

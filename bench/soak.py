#!/usr/bin/env python3
"""Soak test: many randomized sessions against a real server process, checked one by one.

``python bench/soak.py --sessions 200 --concurrency 8 --seed 1`` starts ``python -m
trio_vstream --engine synthetic`` (small frames, short timeouts) as a subprocess, runs a
seeded random mix of session kinds against it over real loopback sockets, and checks
every session's transcript, the server's own record of it (``GET /stats``, the JSON
figures), its log, and at the end whether the process is back where it started (threads,
file descriptors, memory) and stops cleanly on SIGTERM; then, in shutdown rounds, that a
second signal stops a server at once, and that a server exits while engine calls are
stuck. Exit status 1 if anything was violated.

Why a soak, next to the unit and server tests: each guarantee (G1-G5 in docs/architecture.md) has
its own test, but the bugs that matter in production live where they meet: a client
that goes away while its session is being admitted, a ping that arrives while the close
handshake runs, a stall guard racing a stop. Those show up only with many sessions of
different kinds overlapping at random points in time, which is what this does. The seed
fixes the mix and every random choice; the interleavings are whatever the machine makes
of them, so a run is a sample, and the long form (1000 sessions) samples more.

Session kinds (weights in ``KINDS``; each kind runs at least once when --sessions is at
least the number of kinds):

* ``normal``, ``slow_reader`` (delays between reads, far under the stall timeout):
  ``video.start``, media chunks (metadata + one binary message each), the trailer, one
  ``session.done`` with ``stopped: false``, close 1000, every requested frame;
* ``stop``: ``session.stop`` after a random delay; one ``session.done`` (``stopped``
  either way: false when the video was complete first), close 1000;
* ``chatty``: pings, interactions and a reused event id early in the session; each gets
  its answer (``session.pong``, ``session.interaction.queued``, ``event_id_conflict``)
  and the video still completes; ``pings_to_close``: a ping every few ms until the
  connection closes; the terminal message and close 1000 must survive them;
* ``fin`` (``shutdown(SHUT_WR)``: end of stream, no close frame), ``rst``
  (``SO_LINGER`` 0, then close), ``close`` (the client's close frame): before
  ``session.start``, right after it, or mid-stream; abandoned: the server must close its
  side within 2 x slack (3 s, ``Timing.release_bound``), record the session as
  ``disconnected`` (or ``completed``), and log no error;
* ``garbage_start`` / ``garbage_mid``: non-JSON text, binary junk, JSON that is not an
  object, unknown or missing types, a bad interaction (and a bad request instead of
  ``session.start``); each gets an ``error`` with the expected ``code``; in place of the
  start it is the one terminal message (then close 1000), mid-session the session goes
  on and completes;
* ``oversized_start`` / ``oversized_control``: just over the server's byte limits:
  ``message_too_large`` (terminal instead of a start, answered mid-session);
  ``oversized_frame``: beyond the WebSocket message limit (server.py allows twice the
  larger byte limit, so that it can still answer ``message_too_large`` below that): the
  server closes with 1009;
* ``stopped_reader``: a small receive buffer, a long video, and the client stops reading
  after a few messages: the server must abort it (``stalled`` / ``stall_timeout`` in
  /stats) within the stall timeout plus slack of its sends no longer getting through
  (the client's receive queue no longer growing), and close the socket; the client then
  abandons it;
* ``no_start``: nothing sent: ``error`` ``start_timeout`` after ``--start-timeout``, then
  close 1000;
* ``engine_fail`` / ``engine_hang``: ``extra_params.fail_at_chunk`` /
  ``hang_at_chunk`` of the synthetic engine: ``generation_failed``, or ``stall_timeout``
  about ``--stall-timeout`` after the last chunk, then close 1000;
* ``input_video``: a session that follows an input video (``input_video``: JPEG at 12,
  24 or 30 fps, a drawn ``strength``, ``on_end`` ``hold`` or ``end``): once
  ``video.start`` has come, the client sends JPEG frames of the session's size at the
  input's rate while it reads the video, sometimes fewer than the video needs, sometimes
  more, then ``input_video.end``. ``session.done`` with ``stopped: false``, close 1000;
  no frame refused (``invalid_input_frame``); every media chunk's ``input_frames``
  present, never more frames used or dropped than were sent, ``last`` a frame sent and
  never going back, some used; every requested frame, unless the video ended with its
  input (``on_end: "end"``, then shorter, and every frame sent counted exactly once);
* ``engine_stuck``: ``block_at_chunk`` with ``block_seconds``: the engine blocks outside
  any checkpoint (a hung CUDA kernel) for longer than the stall timeout, so that nothing
  can interrupt it: ``stall_timeout`` on time as for a hang, then close 1000, while the
  engine is still blocked. Half the blocks end while the session still waits for its call
  after the close (``returns``: the blocked call must return at least 0.25 s after the
  client had its error; the server's record tells when, as its thread closes the stream
  then), the others after the session ended without it (``abandoned``: the session's
  record shows the stream still open; ``/health``, polled with /stats, must not answer
  ``200 ok`` until the block can have ended: it says ``200 degraded``).

The wedge bound: the server's ``--max-stuck-calls`` is set above what the mix can leave
stuck at once (two calls per session slot, each session's engine call and encoder's as it
ends, and every ``engine_stuck`` block of the run as if all overlapped:
``settings.stuck_calls_bound``), with ``--no-exit-when-wedged``. So ``/health`` says
``200 degraded`` while calls are stuck, and a 503 during the run is a violation (the
server counted more than the mix leaves, or the mix outgrew the bound); the report gives
the most calls ``/health`` said were stuck at once (``health.peak_stuck_calls``). The
batched part below is where the soak wedges a server on purpose.

Admission: the server runs with ``--max-sessions`` equal to ``--concurrency``, and the
soak counts a connection against that from connect until the server has closed its
socket (seen as end-of-stream, or, for abandoned connections, as the server process no
longer holding the socket: ``/proc/net/tcp`` and ``/proc/PID/fd``). So ``server_busy`` is
always a violation, in the session or as the HTTP 503 that refuses the upgrade: it means
the server refused a client that had, by its own count of open connections, room.

Every session the client did not abandon: exactly one terminal message (``session.done``
or an ``error`` that is the last message; an ``error`` answering a bad control message is
not one), then close 1000 and the server's TCP close. Every ``error`` has a ``code``.
Where the client learnt the request id, the server's record of the session
(``recent_sessions`` in /stats, polled every 0.5 s) must show the outcome the kind
allows; no record may say ``internal_error``.

Timing checks allow ``Timing.slack`` (1.5 s) of lateness and 0.2 s of earliness: a
start timeout must fire after 1.0 s (0.8-2.5 s), a hang's or a stuck engine's stall
after 1.5 s (1.3-3.0 s). A stuck engine blocks for 3.5-4.5 s (``returns``) or 10-11 s
(``abandoned``: the stall timeout, the server's 5 s close wait and 2 x slack, and more).
The report lists the measured reaction times (``timings_s``), so the margins can be judged.

At the end, with no sessions running and every stuck engine call returned: ``/stats``
must show ``sessions_active``, ``streams_open`` and ``worker_threads`` at 0, ``/health``
answer ``200 ok``; the process's threads and open file
descriptors must be back to the baseline taken after the warm-up (waiting out the server's
10 s idle trim, bounded), and its RSS within ``RSS_GROWTH_LIMIT_MIB`` of it. Threads are
counted, at the baseline and at the end, once no idle Trio worker thread is alive
(``Trio thread N`` in ``/proc/PID/task/*/comm``, polled; Trio ends one 10 s after its
last job), and a count that differs is reported with the threads' names at both.
SIGTERM must end it with status 0 within ``--shutdown-grace``. The server's log must
hold no ERROR record or traceback other than the injected engine failures'.

The batched part (``--batched-sessions``, default 32, and ``--wedge-rounds``, default 4;
both 0: none; ``bench/_soak/batched.py`` says it step by step): after that, a server of
its own runs the held engine (``bench/_soak/held_engine.py``: shapes batching 4 sessions'
steps; a batch of 2 rows or more sharing an ``extra_params.hold`` token blocks outside any
checkpoint until a file named after the token exists in the soak's hold directory) with
``--max-sessions 4`` and a wedge bound. Its sessions, 4 at a time, must complete. In each
wedge round two sessions share a new token: both clients must get ``stall_timeout``; once
the sessions have waited their close timeout for the held batch, the batcher is stuck and
the server wedged: ``/health`` must answer 503 ``engine_unavailable`` naming the stuck
batched step (within the close timeout plus 2 x slack, 8 s), a new WebSocket upgrade HTTP
503 ``engine_unavailable``, and ``/health`` stay 503 until the soak creates the file; then
``200 ok`` within a slack, and two sessions started at once complete. At the end its
threads, descriptors and RSS are checked against its own baseline as above, its log must
show each wedge's two ERROR records once and no other, and SIGTERM must end it with 0.

Shutdown rounds (``--shutdown-rounds``, default 8; the short form in CI runs none,
``tests/bench/test_soak_shutdown.py`` runs real ones): after the batched part, each
round starts a server of its own (``--shutdown-grace`` 30 s, its default),
alternately with the shapes engine (64x64, batching its sessions' steps, 8 rows at most:
what reaches its step batcher) and the synthetic one, and streams 1-8 sessions of 2400
frames (longer than a round by far). Once every session has had a media chunk, and
0-0.3 s more, it sends SIGTERM or SIGINT (the server drains), then a second signal: in
a fifth of the rounds the other one at once, before the server can have read the first
(Trio reports a signal that arrives again before it was read as one, so the same signal
twice could pass for a single one); otherwise either one once the server has logged the
first, at once in a quarter of those, else after a delay drawn over two of the engine's
steps (shapes: ~0.1 s a batch of 8 rows), so that rounds land before, during and after
a batch. cli/serve.py promises that the second signal stops everything at once, so: the server
logs both signals (``... again: stopping now``) and exits with status 0 within the close
timeout plus 2 x slack (8 s, ``Timing.stop_bound``; it takes 0.2-0.4 s; a drain would take
the 30 s grace), or is killed there; every client got ``video.start`` and media, then
nothing but ``error`` ``server_shutdown`` as its terminal message, if any, and its
connection closed (1000 after a terminal message, else 1006: the process went) after
the first signal and within 2 s of the exit; and the round's log has no ERROR,
traceback or complaint of Python's at exit. A second signal once deadlocked the step
batcher (issue 20, item 11: a cancel in the scheduler tick in which the batcher takes a
batch, before its thread starts, left the rows unfinished and the process never
exited). That window is under a millisecond wide, so a round hits it rarely (12 rounds
of 8 shapes sessions against the old batcher did not); ``tests/scheduling/test_batching_cancel.py``
forces it. The rounds check the whole promise from outside, against real processes, as
an operator's double Ctrl-C meets it. Their plans come from a generator of their own, so
the session mix of a seed is the same with or without them.

Those are ``double_signal`` rounds; one in four (each kind once when there are as many
rounds as kinds) is ``engine_stuck`` instead: the synthetic engine, 1-2 sessions whose
engine blocks outside a checkpoint at chunk 0-2 for 60 s (longer than any bound), the
others streaming. The signals come once those are blocked (their chunks, then 0.3 s of
silence): two as above, or in half of these rounds one, a drain, with stuck sessions only
(each ends by its stall timeout, ``stall_timeout`` then close 1000, which a stuck session
may also get in the other rounds). The process must exit within its bound all the same
(for the drain: ``--shutdown-grace`` plus twice the close timeout and slack, 41.5 s), and
its log must show each stuck call left running as its session ended: the threads were
still blocked when it went (issue 20, item 10: "the drain keeps its bound with a stuck
thread"). The engine's close, as the process ends, releases them.

This file is only the entry point that ``python bench/soak.py`` runs; the code is in
``bench/_soak/`` (one module per concern, listed in its docstring). The package is not
called ``bench/soak/`` because a package and a module of the same name side by side
would make ``import bench.soak`` ambiguous.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._soak.cli import main

if __name__ == "__main__":
    sys.exit(main())

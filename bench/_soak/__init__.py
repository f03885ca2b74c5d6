"""The soak test behind ``python bench/soak.py`` (its docstring says what it checks).

Modules, lowest first (each imports only those above it):

* ``settings``: session kinds and weights, the server's limits and timeouts, thresholds;
* ``held_engine``: the batched part's engine (shapes, whose batched step the soak can
  hold), loaded by that server, not by the soak;
* ``plans``: each session's kind, request and random choices, drawn from the seed;
* ``transcript``: what a client saw and did, and the server's messages read from it;
* ``checks``: the pure checks on a session's transcript and on the server's record of it;
* ``health_checks``: the checks on ``GET /health``'s answers and on the wedge rounds;
* ``shutdown_checks``: the checks on a server's end: its SIGTERM, the shutdown rounds;
* ``serverlog``: the checks on the server's log;
* ``resources``: /proc and /stats snapshots, the leak checks, the socket watch;
* ``client``: one connection and the per-kind drivers;
* ``runner``: the run: workers, admission slots, abandoned connections, settling;
* ``report``: judging every session at the end, violations, the summary;
* ``batched``: the batched part, a server of its own with the held engine, and its
  wedge rounds;
* ``shutdown``: the shutdown rounds, a server each stopped with two signals;
* ``cli``: the command line and the whole run, start to SIGTERM, then the batched part
  and the shutdown rounds.

What the soak shares with the fuzz and ``bench/run.py`` is in ``bench._harness``.
"""

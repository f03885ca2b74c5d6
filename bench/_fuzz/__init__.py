"""The protocol fuzz behind ``python bench/fuzz.py`` (its docstring says what it checks).

Modules, lowest first (each imports only those above it):

* ``settings``: the server it starts, timeouts, the progress line;
* ``wire``: inputs as sent (``Raw`` JSON, byte sizes, padded inputs);
* ``values``: hostile text, boundary numbers, any JSON value, deep nesting, ``weighted``;
* ``objects``: ``session.start``, ``session.interaction`` and other control objects;
* ``strategies``: the messages as sent (text, broken, binary, sized, input video frames)
  and drawing them;
* ``oracle``: pure judgement of what the server sent back;
* ``client``: start connections, the control session, ``GET /health``;
* ``shrinker``: greedy shrinking of a failing input;
* ``serverlog``: the exception a session died of, log excerpts;
* ``runner``: the start and control phases, health checks, the shrink phase;
* ``report``: the JSON report and the printed summary;
* ``cli``: the command line and the whole run, start to SIGTERM.

What the fuzz shares with the soak and ``bench/run.py`` is in ``bench._harness``; the
input video frames it sends, with the soak, in ``bench._frames``.
"""

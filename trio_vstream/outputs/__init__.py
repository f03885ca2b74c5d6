"""Who else gets a session's bytes: its taps, watch links and recordings.

``taps`` is the contract (a session tells its taps what it sent, never waiting for
them); ``watch`` serves read-only viewers of a running session; ``recording`` keeps
each session on disk, through ``_record_writer`` (its writer thread: the queue from
the event loop, the part file, the remux and the JSON record); ``hls`` keeps the end of
a session as a Low-Latency HLS playlist of its own fragments, for HTTP caches to fan
out. None of them can slow the session they follow. ``recording_hls`` plays the
recordings back as HLS (VOD), once their sessions have ended.
"""

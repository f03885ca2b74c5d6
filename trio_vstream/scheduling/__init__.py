"""Where sessions meet the engine: the checkpoint, the batcher and abandonable calls.

Every engine step passes through a session's checkpoint (``steps``): that is where a
stopped session's engine stops within one step, where sessions take turns and where
the stall guard sees progress. A batching engine's steps are formed into batches
there too. ``engine_calls`` runs an engine's blocking call in a thread that the
session may abandon if the call hangs, and keeps count of the calls left behind.
"""

"""Deprecated: the checkpoint engines see is `trio_vstream.engines.Checkpoint`; the server's
side of it is in `trio_vstream.scheduling`."""

from trio_vstream._deprecated import forward

__getattr__ = forward(
    __name__,
    "trio_vstream.engines.contract",
    "trio_vstream.scheduling.checkpoint",
    "trio_vstream.scheduling.batcher",
    "trio_vstream.scheduling.progress",
)

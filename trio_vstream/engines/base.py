"""Deprecated: the engine contract is `trio_vstream.engines` (its module is ``contract``)."""

from trio_vstream._deprecated import forward

__getattr__ = forward(__name__, "trio_vstream.engines.contract")

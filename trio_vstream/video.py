"""Deprecated: the shared value types (`VideoDefaults`, `Camera`, audio rates) are in
`trio_vstream.values`."""

from trio_vstream._deprecated import forward

__getattr__ = forward(__name__, "trio_vstream.values")

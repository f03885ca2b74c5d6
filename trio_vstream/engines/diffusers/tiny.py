"""Deprecated: the tiny random pipelines moved to `trio_vstream.engines.diffusers.testing`.

Its names are looked up there, and importing this module warns (`DeprecationWarning`),
as the package's other old paths do (`trio_vstream._deprecated`): ``from
trio_vstream.engines.diffusers.testing import build_wan_t2v`` instead of ``... .tiny
import build_wan_t2v``. They moved because a module of test builders (close to a
thousand lines, every family's) sat among the engine's run-time modules; the new package
splits them by family. It will be removed in the next release.
"""

from trio_vstream._deprecated import forward
from trio_vstream.engines.diffusers.testing import __all__ as __all__

__getattr__ = forward(__name__, "trio_vstream.engines.diffusers.testing")

"""Old import paths that keep working for one release, with a `DeprecationWarning`.

Issue 31 moved the package's modules into folders. A lab's engine written against the
flat layout (``from trio_vstream.engines.base import Engine``, ``from
trio_vstream.steps import Checkpoint``) still loads: the old module is a shim whose
attributes are looked up in the new modules, and importing it warns once, naming the
new place. CHANGELOG.md lists every moved name. The shims go in the next release.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def forward(old: str, *new: str) -> Callable[[str], Any]:
    """Warn that ``old`` moved, and return a module ``__getattr__`` that finds each name
    in the first of the ``new`` modules that has it."""
    warnings.warn(
        f"{old} is deprecated and will be removed: import from {' or '.join(new)}",
        DeprecationWarning,
        stacklevel=3,
    )
    modules = [importlib.import_module(name) for name in new]

    def __getattr__(name: str) -> Any:
        for module in modules:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__

"""``trio_vstream.engines.diffusers.testing``, the tiny random pipelines' package, and
``tiny``, the module they used to live in: it still imports, warns that it is deprecated,
and gives the very same objects, so code written against the old path keeps working."""

from __future__ import annotations

import importlib
import sys

import pytest

from trio_vstream.engines.diffusers import testing

OLD = "trio_vstream.engines.diffusers.tiny"


def test_the_old_module_warns_and_gives_the_same_objects() -> None:
    # Imported afresh, whatever another test of this process imported before.
    before = sys.modules.pop(OLD, None)
    try:
        with pytest.warns(DeprecationWarning, match=r"engines\.diffusers\.testing"):
            tiny = importlib.import_module(OLD)
    finally:
        if before is not None:
            sys.modules[OLD] = before
    assert sorted(tiny.__all__) == sorted(testing.__all__)
    for name in testing.__all__:
        assert getattr(tiny, name) is getattr(testing, name), name


def test_the_package_names_every_builder_of_its_modules() -> None:
    """Each public name of the family modules is re-exported (what ``tiny`` had)."""
    modules = ["wan", "helios", "skyreels_df", "anyflow_far", "framepack", "sana_wm", "ltx2"]
    for module_name in modules:
        module = importlib.import_module(f"{testing.__name__}.{module_name}")
        public = [
            name
            for name, value in vars(module).items()
            if not name.startswith("_")
            and name != "TYPE_CHECKING"
            and getattr(value, "__module__", module.__name__) == module.__name__
            and (callable(value) or name.isupper())
        ]
        assert public, module_name
        missing = [name for name in public if name not in testing.__all__]
        assert not missing, (module_name, missing)

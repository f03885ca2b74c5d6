"""The registry of pipeline families (``trio_vstream.engines.diffusers.loops``): every
family is one module, listed in ``FAMILIES`` in the order the registry asks them and
imported when asked; the first that recognises a pipeline serves it."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trio_vstream.engines.diffusers import loops
from trio_vstream.engines.diffusers.loops import (
    far,
    forcing,
    framepack,
    history,
    ltx2,
    sana_wm,
    segments,
    wan_v2v,
)


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder the registry reads as part of ``loops`` (as if its modules were there);
    what it imported from it is forgotten afterwards."""
    monkeypatch.setattr(loops, "__path__", [*loops.__path__, str(tmp_path)])
    yield tmp_path
    for module in tmp_path.glob("*.py"):
        sys.modules.pop(f"{loops.__name__}.{module.stem}", None)


def test_the_families_in_the_order_they_are_asked() -> None:
    # The order the families' old ``LOOP.order`` numbers gave (10, 20, 30, 40, 45, 47,
    # 1000), and Wan's video-to-video pipeline before the segment path (which takes any):
    # the same family serves every pipeline as before the list.
    assert loops.FAMILIES == (
        "history",
        "forcing",
        "far",
        "framepack",
        "sana_wm",
        "ltx2",
        "wan_v2v",
        "segments",
    )
    assert loops.registered() == (
        history.LOOP,
        forcing.LOOP,
        far.LOOP,
        framepack.LOOP,
        sana_wm.LOOP,
        ltx2.LOOP,
        wan_v2v.LOOP,
        segments.LOOP,  # last: it takes any pipeline
    )


def test_every_module_that_defines_a_loop_is_listed() -> None:
    """A new family's module left out of ``FAMILIES`` would never be asked: each module
    of the package that defines ``LOOP`` is listed, once, and only those are."""
    defines_loop = {
        module.name
        for module in pkgutil.iter_modules(loops.__path__)
        if hasattr(importlib.import_module(f"{loops.__name__}.{module.name}"), "LOOP")
    }
    assert len(set(loops.FAMILIES)) == len(loops.FAMILIES), loops.FAMILIES
    assert set(loops.FAMILIES) == defines_loop


def test_the_package_imports_no_family() -> None:
    """The registry imports a family's module when it asks it, not before."""
    code = (
        "import sys\n"
        "import trio_vstream.engines.diffusers.loops as loops\n"
        "print(sorted(f for f in loops.FAMILIES if f'{loops.__name__}.{f}' in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.strip() == "[]", result.stderr


def test_a_new_family_is_its_module_and_its_place_in_the_list(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module beside the others, listed before the segment path, serves the pipelines
    it recognises; the families after it are not asked, nor imported."""
    (folder / "newfamily.py").write_text(
        "class NewFamily:\n"
        "    name = 'new'\n"
        "    def recognises(self, info):\n"
        "        return info.class_name == 'NewPipeline'\n"
        "LOOP = NewFamily()\n"
    )
    (folder / "after.py").write_text("raise AssertionError('asked after the one that served')\n")
    monkeypatch.setattr(loops, "FAMILIES", ("newfamily", "after", "segments"))
    pipeline = SimpleNamespace(class_name="NewPipeline", params={}, pipe=None)
    assert loops.loop_for(pipeline).name == "new"  # type: ignore[arg-type]
    assert f"{loops.__name__}.after" not in sys.modules


def test_a_listed_module_without_a_loop_is_an_error(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (folder / "notafamily.py").write_text("X = 1\n")
    monkeypatch.setattr(loops, "FAMILIES", ("notafamily", "segments"))
    with pytest.raises(ImportError, match="notafamily: a family's module defines LOOP"):
        loops.registered()


# The modules of the old circle (the stream imported the registry, whose protocol
# imported the stream), and families that import the stream's helpers.
FIRST_IMPORTS = [
    "trio_vstream.engines.diffusers.loops._protocol",
    "trio_vstream.engines.diffusers.loops",
    "trio_vstream.engines.diffusers._stream",
    "trio_vstream.engines.diffusers.loops.segments",
    "trio_vstream.engines.diffusers.loops.sana_wm",
]


@pytest.mark.slow
@pytest.mark.parametrize("module", FIRST_IMPORTS)
def test_each_module_imports_first_in_a_fresh_interpreter(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr


def test_a_fixed_length_pipeline_takes_the_segment_path(
    models: SimpleNamespace, make_engine: Any
) -> None:
    assert make_engine(models.t2v).loop is segments.LOOP
    assert make_engine(models.t2v, i2v_model=str(models.i2v)).loop is segments.LOOP

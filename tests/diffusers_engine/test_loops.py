"""The registry of pipeline families (``trio_vstream.engines.diffusers.loops``): every
family is one module, found without being listed, asked in its order; the first that
recognises a pipeline serves it."""

from __future__ import annotations

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
)


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """The registry read again (it is read once per process), and as it was afterwards."""
    loops.registered.cache_clear()
    yield
    loops.registered.cache_clear()


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: None) -> Iterator[Path]:
    """A folder the registry reads as part of ``loops`` (as if its modules were there);
    what it imported from it is forgotten afterwards."""
    monkeypatch.setattr(loops, "__path__", [*loops.__path__, str(tmp_path)])
    yield tmp_path
    for module in tmp_path.glob("*.py"):
        sys.modules.pop(f"{loops.__name__}.{module.stem}", None)


def test_the_families_in_the_order_they_are_asked(fresh_registry: None) -> None:
    assert loops.registered() == (
        history.LOOP,
        forcing.LOOP,
        far.LOOP,
        framepack.LOOP,
        sana_wm.LOOP,
        ltx2.LOOP,
        segments.LOOP,  # last: it takes any pipeline
    )


def test_a_new_family_is_one_module_in_the_folder(folder: Path) -> None:
    """A module dropped beside the others is asked in its order, before the segment
    path; a private module there is not a family."""
    (folder / "newfamily.py").write_text(
        "class NewFamily:\n"
        "    name = 'new'\n"
        "    order = 50\n"
        "    def recognises(self, info):\n"
        "        return info.class_name == 'NewPipeline'\n"
        "LOOP = NewFamily()\n"
    )
    (folder / "_helpers.py").write_text("raise AssertionError('not a family')\n")
    found = loops.registered()
    assert [loop.name for loop in found][-2:] == ["new", "segments"]
    pipeline = SimpleNamespace(class_name="NewPipeline", params={}, pipe=None)
    assert loops.loop_for(pipeline).name == "new"  # type: ignore[arg-type]


def test_a_module_without_a_loop_is_an_error(folder: Path) -> None:
    (folder / "notafamily.py").write_text("X = 1\n")
    with pytest.raises(ImportError, match="notafamily: a family's module defines LOOP"):
        loops.registered()


def test_two_families_of_one_order_are_an_error(folder: Path) -> None:
    twin = "class Twin:\n    name = 'twin'\n    order = 10\nLOOP = Twin()\n"
    (folder / "twin.py").write_text(twin)  # Helios' order
    with pytest.raises(ImportError, match="two families share an order"):
        loops.registered()


def test_a_fixed_length_pipeline_takes_the_segment_path(
    models: SimpleNamespace, make_engine: Any
) -> None:
    assert make_engine(models.t2v).loop is segments.LOOP
    assert make_engine(models.t2v, i2v_model=str(models.i2v)).loop is segments.LOOP

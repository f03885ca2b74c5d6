"""Attack: a request's ``lora`` names files on the server (issue 20, item 3).

Only files inside the operator's ``lora_root`` may be loaded: ``lora.weight_name`` is a
bare ``.safetensors`` file name, ``lora.path`` and the file are resolved (links and
``..`` included) and confined to the resolved root, diffusers is handed that one file,
and a client learns nothing about files outside the root from the error it gets.

The first tests check the parsing alone on a directory tree made here (no pipeline);
the last ones load LoRAs into the tiny Wan pipeline of ``tests/engines/diffusers``.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.engines.diffusers.conftest import make_engine, models  # noqa: F401 (fixtures)
from tests.engines.diffusers.support import no_stop, request
from trio_vstream.engines import EngineError, InvalidRequestError
from trio_vstream.engines.diffusers._lora import NOT_FOUND, parse_lora_spec

WEIGHTS = "pytorch_lora_weights.safetensors"


@pytest.fixture
def tree(tmp_path: Path) -> SimpleNamespace:
    """``root`` (the lora_root) with a LoRA directory, a LoRA file and links that lead
    out of it; ``outside`` beside it, with a file a client must not reach."""
    root = tmp_path / "loras"
    (root / "good").mkdir(parents=True)
    (root / "good" / WEIGHTS).write_bytes(b"inside")
    (root / "good" / "other.safetensors").write_bytes(b"inside")
    (root / "flat.safetensors").write_bytes(b"inside")
    (root / "good" / "weights.bin").write_bytes(b"pickle")
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret.safetensors"
    secret.write_bytes(b"outside")
    (outside / WEIGHTS).write_bytes(b"outside")
    (root / "escape").symlink_to(outside, target_is_directory=True)
    (root / "escape.safetensors").symlink_to(secret)
    (root / "good" / "link.safetensors").symlink_to(secret)
    return SimpleNamespace(root=root, outside=outside, secret=secret)


def refusal(tree: SimpleNamespace, **lora: Any) -> str:
    """The problems ``lora`` is refused with (it must be refused)."""
    spec, problems = parse_lora_spec(lora, tree.root)
    assert spec is None, f"{lora} was accepted: {spec}"
    assert problems
    return "; ".join(problems)


@pytest.mark.parametrize(
    "weight_name",
    [
        "../outside/secret.safetensors",  # up and out of lora.path
        "../../outside/secret.safetensors",
        "..",
        ".",
        "good/other.safetensors",  # any separator: a bare name only
        "..\\outside\\secret.safetensors",
        ".hidden.safetensors",
        "secret.safetensors\x00.bin",
        "weights.bin",  # pickles are never loaded
        "",
        "a" * 250 + ".safetensors",
        5,
    ],
)
def test_weight_name_must_be_a_bare_safetensors_file_name(
    tree: SimpleNamespace, weight_name: Any
) -> None:
    message = refusal(tree, path="good", weight_name=weight_name)
    assert "lora.weight_name must be a bare file name ending in .safetensors" in message


def test_an_absolute_weight_name_is_refused(tree: SimpleNamespace) -> None:
    message = refusal(tree, path="good", weight_name=str(tree.secret))
    assert "lora.weight_name must be a bare file name" in message


@pytest.mark.parametrize(
    "lora",
    [
        {"path": "escape", "weight_name": "secret.safetensors"},  # a directory link
        {"path": "escape"},  # ... and the default file name through it
        {"path": "escape.safetensors"},  # a file link
        {"path": "good", "weight_name": "link.safetensors"},  # a link as the weight file
    ],
)
def test_a_link_inside_lora_root_leading_out_is_refused(
    tree: SimpleNamespace, lora: dict[str, str]
) -> None:
    assert refusal(tree, **lora) == NOT_FOUND


@pytest.mark.parametrize(
    "path",
    ["../outside", "../outside/secret.safetensors", "good/../../outside", "good/../.."],
)
def test_a_path_with_dotdot_leading_out_is_refused(tree: SimpleNamespace, path: str) -> None:
    assert refusal(tree, path=path) == NOT_FOUND


def test_an_absolute_path_outside_is_refused(tree: SimpleNamespace) -> None:
    assert refusal(tree, path=str(tree.secret)) == NOT_FOUND
    assert refusal(tree, path=str(tree.outside)) == NOT_FOUND


def test_the_refusal_does_not_tell_whether_a_file_outside_exists(tree: SimpleNamespace) -> None:
    """An existence oracle: an existing file outside, a missing one outside, a missing
    one inside, a directory without a LoRA file, a pickle: one message for all."""
    messages = {
        refusal(tree, path="../outside/secret.safetensors"),
        refusal(tree, path="../outside/absent.safetensors"),
        refusal(tree, path=str(tree.secret)),
        refusal(tree, path=str(tree.outside / "absent.safetensors")),
        refusal(tree, path="../outside", weight_name="secret.safetensors"),
        refusal(tree, path="../outside", weight_name="absent.safetensors"),
        refusal(tree, path="absent.safetensors"),
        refusal(tree, path="good", weight_name="absent.safetensors"),
        refusal(tree, path="flat.safetensors", weight_name="other.safetensors"),
        refusal(tree, path="good/weights.bin"),
        refusal(tree, path="escape/secret.safetensors"),
        refusal(tree, path="escape/absent.safetensors"),
    }
    assert messages == {NOT_FOUND}
    assert "secret" not in NOT_FOUND and str(tree.root) not in NOT_FOUND


def test_the_log_says_why_a_lora_was_refused(
    tree: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="trio_vstream.engines.diffusers"):
        refusal(tree, path="escape.safetensors")
        refusal(tree, path="absent.safetensors")
    outside, missing = (r.getMessage() for r in caplog.records)
    assert "escape.safetensors" in outside and "outside lora_root" in outside
    assert "absent.safetensors" in missing and "FileNotFoundError" in missing


@pytest.mark.parametrize("path", ["good\x00", "good\nforged log line", "x" * 5000, ""])
def test_lora_path_must_be_printable_and_bounded(tree: SimpleNamespace, path: str) -> None:
    assert "lora.path must be a path" in refusal(tree, path=path)


@pytest.mark.parametrize(
    ("lora", "file"),
    [
        ({"path": "good"}, "good/" + WEIGHTS),  # a directory: diffusers' own file name
        ({"path": "good", "weight_name": "other.safetensors"}, "good/other.safetensors"),
        ({"path": "flat.safetensors"}, "flat.safetensors"),  # the file itself
        ({"path": "good/./../good"}, "good/" + WEIGHTS),  # .. that stays inside is fine
    ],
)
def test_legal_loras_resolve_to_one_file_inside(
    tree: SimpleNamespace, lora: dict[str, str], file: str
) -> None:
    spec, problems = parse_lora_spec(lora, tree.root)
    assert problems == [] and spec is not None
    assert spec.file == (tree.root / file).resolve()
    # Absolute paths inside the root are taken too.
    absolute = {**lora, "path": str(tree.root / lora["path"])}
    spec, problems = parse_lora_spec(absolute, tree.root)
    assert problems == [] and spec is not None and spec.file == (tree.root / file).resolve()


def test_lora_root_itself_reached_through_a_link_still_confines(tmp_path: Path) -> None:
    """The root is resolved too: a lora_root given as a link confines to its target."""
    real = tmp_path / "real"
    (real / "a").mkdir(parents=True)
    (real / "a" / WEIGHTS).write_bytes(b"x")
    (tmp_path / WEIGHTS).write_bytes(b"outside")
    link = tmp_path / "root-link"
    link.symlink_to(real, target_is_directory=True)
    spec, problems = parse_lora_spec({"path": "a"}, link)
    assert problems == [] and spec is not None and spec.file == real / "a" / WEIGHTS
    spec, problems = parse_lora_spec({"path": ".."}, link)
    assert spec is None and problems == [NOT_FOUND]


# ------------------------------------------------------------------ on the pipeline


def test_a_weight_name_leading_out_never_loads_that_file(
    models: SimpleNamespace,  # noqa: F811
    make_engine: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The reproduction: a LoRA outside lora_root, reached by weight_name ``..``. It is
    refused when the session opens, and nothing is loaded."""
    root = tmp_path / "loras"
    root.mkdir()
    engine = make_engine(models.t2v, lora_root=str(root))
    outside = models.lora / WEIGHTS  # a real LoRA, outside this lora_root
    escape = os.path.relpath(outside, root)
    assert escape.startswith("..")
    for lora in ({"path": ".", "weight_name": escape}, {"path": ".", "weight_name": str(outside)}):
        with pytest.raises(InvalidRequestError, match=r"lora\.weight_name must be a bare file"):
            engine.open_stream(request(lora=lora))
    with pytest.raises(InvalidRequestError) as refused:
        engine.open_stream(request(lora={"path": str(outside)}))
    assert str(refused.value) == NOT_FOUND
    assert not any("lora_A" in n for n, _ in engine.model.pipe.transformer.named_modules())


def test_a_legal_lora_loads_from_its_resolved_file(
    models: SimpleNamespace,  # noqa: F811
    make_engine: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """diffusers is handed the one resolved file, safetensors only: never a directory and
    a name for it to join, nor a pickle to fall back to."""
    root = tmp_path / "loras"
    shutil.copytree(models.lora, root / "mine")
    engine = make_engine(models.t2v, lora_root=str(root))
    pipe = engine.model.pipe
    calls: list[tuple[Any, dict[str, Any]]] = []
    load = pipe.load_lora_weights

    def spy(path: Any, **kwargs: Any) -> Any:
        calls.append((path, kwargs))
        return load(path, **kwargs)

    pipe.load_lora_weights = spy
    try:
        for lora in ({"path": "mine"}, {"path": "mine/../mine", "weight_name": WEIGHTS}):
            stream = engine.open_stream(request(num_frames=5, lora=lora))
            try:
                assert stream.next_chunk(no_stop) is not None
                assert any("lora_A" in n for n, _ in pipe.transformer.named_modules())
            finally:
                stream.close()
    finally:
        del pipe.load_lora_weights
    expected = str((root / "mine" / WEIGHTS).resolve())
    assert [path for path, _ in calls] == [expected, expected]
    for _, kwargs in calls:
        assert kwargs["use_safetensors"] is True and "weight_name" not in kwargs


def test_a_link_swapped_in_after_the_check_is_not_followed(
    models: SimpleNamespace,  # noqa: F811
    make_engine: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The file is checked when the session opens and loaded at its first segment; if a
    link has replaced a directory on its path meanwhile, the load is refused, and the
    error names the client's own path, not the server's."""
    root = tmp_path / "loras"
    shutil.copytree(models.lora, root / "mine")
    engine = make_engine(models.t2v, lora_root=str(root))
    stream = engine.open_stream(request(num_frames=5, lora={"path": "mine"}))
    try:
        shutil.rmtree(root / "mine")
        (root / "mine").symlink_to(models.lora, target_is_directory=True)  # leads out
        with pytest.raises(EngineError) as failed:
            stream.next_chunk(no_stop)
    finally:
        stream.close()
    assert str(failed.value) == "cannot load LoRA mine"
    assert not any("lora_A" in n for n, _ in engine.model.pipe.transformer.named_modules())

"""The docs say what the code does: the README's examples run, its wire exchange is what a
server sends, and the layout map in ``docs/architecture.md`` names every folder.

``mkdocs build --strict`` (tox's test environment) checks the links between the pages;
these tests check what a link checker cannot: that the examples a newcomer copies work,
and that the one map of the code is not stale.
"""

from __future__ import annotations

import ast
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import pytest
import trio

from trio_vstream import protocol

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"

pytestmark = pytest.mark.timeout(60)


def fenced_blocks(path: Path, language: str) -> list[str]:
    """The contents of every fenced code block of ``language`` in a Markdown file."""
    pattern = rf"^```{re.escape(language)}\n(.*?)^```$"
    return re.findall(pattern, path.read_text(), flags=re.MULTILINE | re.DOTALL)


def test_the_readme_stays_short() -> None:
    """A five-minute read (issue 21): reference material goes to a page in docs/."""
    lines = README.read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move reference material to docs/"


# --- The Python example ------------------------------------------------------------------

EXAMPLE_URL = "ws://127.0.0.1:8000/v1/realtime/video"


def stream_video_examples() -> Iterator[Any]:
    for path in (README, DOCS / "client.md"):
        blocks = [b for b in fenced_blocks(path, "python") if "stream_video(" in b]
        assert blocks, f"{path.name} has no stream_video example"
        for block in blocks:
            yield pytest.param(block, id=path.name)


@pytest.mark.parametrize("example", list(stream_video_examples()))
async def test_the_stream_video_example_runs_against_a_server(
    example: str,
    start_server: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The example as printed, but for the server's address; it ends in ``trio.run(main)``,
    which is left out here, since the test already runs in Trio: ``main()`` is awaited."""
    module = ast.parse(example)
    last = module.body[-1]
    assert ast.unparse(last) == "trio.run(main)", "the example ends by running main"
    assert example.count(EXAMPLE_URL) == 1, "the example streams from the quick start's server"
    server = await start_server()
    body = ast.unparse(ast.Module(body=module.body[:-1], type_ignores=[]))
    namespace: dict[str, Any] = {}
    exec(body.replace(EXAMPLE_URL, server.url), namespace)
    monkeypatch.chdir(tmp_path)

    await namespace["main"]()

    printed = capsys.readouterr().out.split()
    outcome, frames = printed[0], int(printed[1])
    assert outcome == "completed"
    with av.open(str(tmp_path / "clip.mp4")) as container:
        decoded = sum(1 for _ in container.decode(video=0))
    assert frames == decoded > 0


# --- The wire exchange -------------------------------------------------------------------

ARROWS = ("→ ", "← ")
# Values the exchange shows that do not depend on the engine, the machine or the run.
STABLE_KEYS = (
    "type",
    "kind",
    "format",
    "num_frames",
    "generation_chunk_index",
    "event_id",
    "chunks",
    "stopped",
)


def readme_exchange() -> list[tuple[str, str]]:
    """The README's wire exchange: (direction, line), ``→`` from the client."""
    [block] = [b for b in fenced_blocks(README, "text") if b.startswith(ARROWS)]
    lines = block.strip().splitlines()
    assert all(line.startswith(ARROWS) for line in lines)
    return [(line[0], line[2:]) for line in lines]


def shown_values(line: str) -> dict[str, Any]:
    """The stable scalar values a line of the exchange shows (it elides others with …)."""
    values = {}
    for key, raw in re.findall(r'"(\w+)": ("[^"…]*"|-?\d+|true|false|null)(?=[,}])', line):
        if key in STABLE_KEYS:
            values[key] = json.loads(raw)
    return values


def keys_of(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in keys_of(v)}
    if isinstance(value, list):
        return {k for v in value for k in keys_of(v)}
    return set()


def test_the_client_messages_of_the_exchange_are_valid() -> None:
    sent = [line for direction, line in readme_exchange() if direction == "→"]
    assert isinstance(protocol.parse_start(sent[0]), protocol.SessionStart)
    for line in sent[1:]:
        protocol.parse_control(line)
    received = [line for direction, line in readme_exchange() if direction == "←"]
    # Each binary message is as long as the metadata before it says.
    for before, line in itertools.pairwise(received):
        if line.startswith("binary, "):
            length = int(line.removeprefix("binary, ").split()[0])
            assert shown_values(before)["type"] == "video.chunk_metadata"
            assert f'"byte_length": {length},' in before


async def test_the_exchange_is_what_a_server_sends(start_server: Any) -> None:
    """The README's client messages, sent to a real server: the same messages come back,
    in the same order, with the fields and values the README shows.

    Only where ``session.interaction.queued`` falls among the chunks depends on timing,
    so it is compared apart."""
    exchange = readme_exchange()
    sent = [line for direction, line in exchange if direction == "→"]
    shown = [line for direction, line in exchange if direction == "←"]
    server = await start_server()
    received: list[dict[str, Any] | bytes] = []
    with trio.fail_after(30):
        async with server.connect() as ws:
            await ws.send_message(sent[0])
            while True:
                message = await ws.get_message()
                if isinstance(message, bytes):
                    received.append(message)
                    continue
                received.append(json.loads(message))
                kind = received[-1]["type"]
                if kind == "video.start":
                    for line in sent[1:]:
                        await ws.send_message(line)
                if kind in ("session.done", "error"):
                    break

    def queued(item: str | dict[str, Any] | bytes) -> bool:
        if isinstance(item, str):
            return '"session.interaction.queued"' in item
        return isinstance(item, dict) and item["type"] == "session.interaction.queued"

    assert len([s for s in shown if queued(s)]) == len([r for r in received if queued(r)]) == 1
    shown = [s for s in shown if not queued(s)]
    received = [r for r in received if not queued(r)]
    assert len(shown) == len(received), (shown, received)
    for line, message in zip(shown, received, strict=True):
        if line.startswith("binary, "):
            assert isinstance(message, bytes), line
            continue
        assert isinstance(message, dict), line
        assert shown_values(line).items() <= message.items(), (line, message)
        assert set(re.findall(r'"(\w+)":', line)) <= keys_of(message), (line, message)


# --- The layout map ----------------------------------------------------------------------


def layout_map() -> str:
    text = (DOCS / "architecture.md").read_text()
    [block] = re.findall(r"^## Layout\n.*?^```\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    return block


def layout_entries() -> dict[str, str]:
    """Each path the map names (``trio_vstream/engines/contract.py``, ``bench/``), with its
    description. An entry is indented two spaces per level; a description that goes on
    is indented further than an entry under it would be."""
    entries: dict[str, str] = {}
    parents: list[str] = []
    last, last_indent = "", 0
    for line in layout_map().splitlines():
        indent = len(line) - len(line.lstrip())
        if last and indent > last_indent + 2:
            entries[last] += " " + line.strip()
            continue
        last_indent = indent
        level = indent // 2
        assert indent % 2 == 0 and level <= len(parents), f"misplaced entry: {line!r}"
        del parents[level:]
        name, _, description = line.strip().partition(" ")
        last = "".join(parents) + name
        entries[last] = description.strip()
        parents.append(name if name.endswith("/") else "")
    return entries


def test_every_entry_of_the_layout_map_exists() -> None:
    missing = [path for path in layout_entries() if not (REPO / path).exists()]
    assert not missing, f"the layout map names what is not there: {missing}"


def test_the_layout_map_names_every_folder_and_top_module() -> None:
    """A line per folder of the package (a floor, or a room inside one) and per module at
    its top; key modules may have lines of their own, and every folder's ``__init__.py``
    says what its modules hold, so that the map stays a map."""
    entries = layout_entries()
    package = REPO / "trio_vstream"
    folders = [
        p.relative_to(REPO).as_posix() + "/"
        for p in package.rglob("*")
        if p.is_dir() and (p / "__init__.py").exists() and "__pycache__" not in p.parts
    ]
    top = [p.relative_to(REPO).as_posix() for p in package.glob("*.py") if p.name != "__init__.py"]
    assert "trio_vstream/session/" in folders and "trio_vstream/values.py" in top
    missing = sorted(path for path in [*folders, *top] if path not in entries)
    assert not missing, f"docs/architecture.md's layout map lacks {missing}"
    undocumented = sorted(
        folder
        for folder in folders
        if not ast.get_docstring(ast.parse((REPO / folder / "__init__.py").read_text()))
    )
    assert not undocumented, f"these folders' __init__.py say nothing: {undocumented}"


def test_the_layout_map_names_everything_in_bench() -> None:
    description = layout_entries()["bench/"]
    named = set(re.findall(r"[\w.]+/?", description))
    ignored = {"__init__.py", "__pycache__", "README.md"}
    present = sorted(p.name for p in (REPO / "bench").iterdir() if p.name not in ignored)
    missing = [
        name
        for name in present
        if not ({name, name.removesuffix(".py"), name + "/"} & named)
        and not ((REPO / "bench" / name).is_dir() and name + "/" in named)
    ]
    assert not missing, f"the layout map's bench/ entry does not name {missing}"


def test_the_layout_map_names_every_folder_of_tests() -> None:
    """Each folder of tests/ is a subsystem, and the map says which."""
    entries = layout_entries()
    folders = sorted(
        f"tests/{p.name}/" for p in (REPO / "tests").iterdir() if (p / "__init__.py").exists()
    )
    assert folders
    missing = [folder for folder in folders if folder not in entries]
    assert not missing, f"docs/architecture.md's layout map lacks {missing}"

"""What users of the package import and type keeps working when the code inside moves.

Issue 31 moved every module into folders. These pin what a user meets: the command line
and its flags, the client library's names, the engine contract from
``trio_vstream.engines``, ``--engine module:factory``, the names at the package's top, and
the old import paths an engine of a lab's own may use, which keep working for one
release with a `DeprecationWarning` that names the new place. A name may be added; one
that goes is a decision for CHANGELOG.md, made by editing this file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import trio_vstream
import trio_vstream.client
import trio_vstream.engines
from trio_vstream.cli import build_parser
from trio_vstream.engines import load_engine
from trio_vstream.engines.synthetic import SyntheticEngine

ROOT = Path(__file__).resolve().parent.parent

FLAGS = {
    "serve": """--admin-api-key --admin-api-key-file --allow-image-urls --allowed-hosts
        --allowed-origins --api-key --api-key-file --device --encode-concurrency --engine
        --engine-arg --exit-when-wedged --head-timeout --hls-linger --hls-part-seconds
        --hls-segment-seconds --host --image-url-max-bytes
        --image-url-max-redirects --image-url-timeout --log-level --max-connections
        --max-connections-per-ip --max-control-bytes --max-height --max-num-frames
        --max-sessions --max-start-bytes --max-stuck-calls --max-total-pixels --max-viewers
        --max-width --model --no-exit-when-wedged --no-hls --node-name --peer --peer-domain --port
        --record --record-max-bytes
        --shutdown-grace --ssl-certfile --ssl-keyfile --stall-timeout --start-timeout
        --watch-requires-key""",
    "client": """--api-key --buffer-seconds --camera --connect-timeout --fps
        --guidance-scale --image --input-end --input-fps --input-size --input-video
        --interact --json --keys --model --negative-prompt --num-frames --output -o
        --param --playback --raw --seconds --seed --size --startup-seconds --steps
        --stop-timeout --strength --transition-chunks --url""",
    "watch": "--api-key --connect-timeout --json --output -o --raw --url",
    "replay": "--api-key --connect-timeout --image --keep-codec-options --output -o --url",
}

CLIENT_NAMES = """API_KEY_ENV ChunkCallback DEFAULT_URL EXIT_CONNECTION EXIT_INTERRUPTED
    EXIT_MISMATCH EXIT_OK EXIT_OUTPUT EXIT_SERVER_ERROR EXIT_USAGE InteractionRecord
    MAX_MESSAGE_SIZE MessageCallback PlaybackViewer ReceivedChunk RemuxError ReplayError
    ReplayPlan ReplayReport ScheduledInteraction StreamConnectError StreamOutcome
    StreamResult ViewerFigures add_client_arguments add_replay_arguments
    add_watch_arguments check_startup load_recording remux_to_mp4 replay run_client
    run_replay run_watch stream_video watch_link_url watch_video"""

ENGINE_NAMES = """BUILTIN_ENGINES BatchRunner Checkpoint Chunk ChunkConditioning
    DEFAULT_INTERACTION_KINDS DeferredFrames Engine EngineConfigError EngineError
    EngineFactory EngineStream GenerationRequest InvalidRequestError PromptChange
    PromptSchedule RunBatch SamplingSettings batch_result batched checkpoint_calling
    interaction_kinds load_engine release_frames"""

TOP_NAMES = "Engine EngineStream Limits ServerConfig SessionConfig VideoServer load_engine serve"


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def test_every_subcommand_keeps_its_flags() -> None:
    parser = build_parser()
    (subcommands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(FLAGS) <= set(subcommands.choices)
    for command, flags in FLAGS.items():
        missing = set(flags.split()) - _flags(subcommands.choices[command])
        assert not missing, f"{command} lost {sorted(missing)}"
    assert {"--version", "--help"} <= _flags(parser)


@pytest.mark.parametrize(
    ("module", "names"),
    [
        (trio_vstream.client, CLIENT_NAMES),
        (trio_vstream.engines, ENGINE_NAMES),
        (trio_vstream, TOP_NAMES),
    ],
    ids=["client", "engines", "top"],
)
def test_the_public_names_are_still_there(module: object, names: str) -> None:
    missing = [name for name in names.split() if getattr(module, name, None) is None]
    assert not missing, f"{module} lost {missing}"


def test_the_server_and_session_folders_still_give_their_public_names() -> None:
    from trio_vstream.server import ServerConfig, VideoServer, serve
    from trio_vstream.session import SessionConfig

    assert (trio_vstream.VideoServer, trio_vstream.ServerConfig) == (VideoServer, ServerConfig)
    assert (trio_vstream.serve, trio_vstream.SessionConfig) == (serve, SessionConfig)


def test_an_engine_of_ones_own_loads_by_module_and_factory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "lab_engine.py").write_text(
        textwrap.dedent(
            """
            from trio_vstream.engines.synthetic import SyntheticEngine

            def make(device="auto", **args):
                return SyntheticEngine()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(load_engine("lab_engine:make", {}), SyntheticEngine)


# Each old path, a name it gave, and where that name lives now.
OLD_PATHS = [
    ("trio_vstream.engines.base", "Engine", "trio_vstream.engines"),
    ("trio_vstream.engines.base", "Checkpoint", "trio_vstream.engines"),
    ("trio_vstream.steps", "Checkpoint", "trio_vstream.engines"),
    ("trio_vstream.steps", "SessionCheckpoint", "trio_vstream.scheduling.checkpoint"),
    ("trio_vstream.steps", "StepBatcher", "trio_vstream.scheduling.batcher"),
    ("trio_vstream.video", "VideoDefaults", "trio_vstream.values"),
]

# In a fresh interpreter, where the old module is imported for the first time (the
# warning comes once, with the import): the warnings it gave, and whether each name is
# the very object at its new place.
PROBE = """\
import importlib, json, sys, warnings
old, name, new = sys.argv[1:]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    value = getattr(importlib.import_module(old), name)
print(json.dumps({
    "same": value is getattr(importlib.import_module(new), name),
    "warnings": [(w.category.__name__, str(w.message)) for w in caught],
}))
"""


@pytest.mark.parametrize(("old", "name", "new"), OLD_PATHS)
def test_an_old_import_path_works_and_warns(old: str, name: str, new: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, old, name, new],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout)
    assert probe["same"]
    ours = [message for category, message in probe["warnings"] if old in message]
    assert [category for category, message in probe["warnings"] if old in message] == [
        "DeprecationWarning"
    ]
    assert "import from" in ours[0]


def test_an_old_path_refuses_a_name_it_never_had() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import trio_vstream.video

    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        trio_vstream.video.Nothing  # noqa: B018 (the lookup is the test)

"""``extra_params.interaction_script``: interactions a session applies before given chunks.

This project's extension, the twin of ``camera_action_script`` (`_camera_script`): a
recording replayed at the same chunk indices, which a client racing a fast engine over
the network cannot do. Apart from `_start` because an entry is checked by the very
parser live interactions go through (`_control.parse_control`), so that a script entry
is exactly what a live interaction may be: this module sits above that parser, and
`_start` above it.
"""

from typing import Any, Final

import attrs

from trio_vstream.protocol._camera_script import CAMERA_SCRIPT_PARAM
from trio_vstream.protocol._control import parse_control
from trio_vstream.protocol._errors import ProtocolError
from trio_vstream.protocol._limits import DEFAULT_LIMITS, Limits
from trio_vstream.protocol._messages import Interaction
from trio_vstream.protocol._wire import dump_json, quote, show
from trio_vstream.values import Camera

INTERACTION_SCRIPT_PARAM: Final = "interaction_script"
"""This project's extension: the ``extra_params`` key of an interaction script (the
server applies it and never passes it to an engine)."""

_SCRIPT_WHERE: Final = f"extra_params.{INTERACTION_SCRIPT_PARAM}"
_SCRIPT_KEYS: Final = ("chunk_index", "interaction")
_MAX_SCRIPT_PROBLEMS: Final = 10


@attrs.frozen
class ScriptedInteraction:
    """One entry of ``extra_params.interaction_script``: an interaction the session hands
    the engine right before generation chunk ``chunk_index``, exactly as if a client had
    sent it during the chunk before. What replays a recording at the same chunk indices,
    which a client racing a fast engine over the network cannot do."""

    chunk_index: int
    event_id: str
    prompt: str | None
    transition_chunks: int | None = None
    camera: Camera | None = None


def interaction_script_of(
    extra_params: dict[str, Any] | None,
    num_frames: int | None,
    camera_scripted: bool,
    problems: list[str],
) -> tuple[ScriptedInteraction, ...]:
    """The request's interaction script, in chunk order (empty: none).

    Each entry is ``{"chunk_index": K, "interaction": {...}}``, the ``interaction`` object
    of a ``session.interaction`` message, checked by the same parser (so a script entry is
    exactly what a live interaction may be) plus what a script needs: an ``event_id``
    (how a chunk's ``started_event_ids`` names it), unique, and not a camera script's
    reserved ``script-<n>``; no camera when ``camera_action_script`` owns the camera; a
    chunk index the video can reach. Every bad entry is named by its path.
    """
    if not extra_params or INTERACTION_SCRIPT_PARAM not in extra_params:
        return ()
    script = extra_params[INTERACTION_SCRIPT_PARAM]
    if not isinstance(script, list) or not script:
        got = "an empty array" if script == [] else show(script)
        problems.append(f"{_SCRIPT_WHERE} must be a non-empty array of entries, got {got}")
        return ()
    entries: list[ScriptedInteraction] = []
    refused: list[str] = []
    seen: dict[str, int] = {}
    for index, value in enumerate(script):
        where = f"{_SCRIPT_WHERE}[{index}]"
        if not isinstance(value, dict):
            refused.append(f"{where} must be an object with chunk_index and interaction")
            continue
        unknown = sorted(str(key) for key in value if key not in _SCRIPT_KEYS)
        missing = [key for key in _SCRIPT_KEYS if key not in value]
        if unknown or missing:
            what = f"unknown field {quote(unknown[0])}" if unknown else f"no {missing[0]}"
            refused.append(f"{where} has {what} (an entry holds chunk_index and interaction)")
            continue
        chunk = value["chunk_index"]
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            refused.append(f"{where}.chunk_index must be an integer >= 0, got {show(chunk)}")
            continue
        if num_frames is not None and chunk >= num_frames:
            refused.append(
                f"{where}.chunk_index is {chunk}, but the video has only {num_frames} frames"
            )
            continue
        try:
            message = parse_control(
                dump_json({"type": Interaction.TYPE, "interaction": value["interaction"]}),
                limits=Limits(max_control_bytes=DEFAULT_LIMITS.max_start_bytes),
            )
        except ProtocolError as exc:
            refused.append(f"{where}.interaction: {exc.message}")
            continue
        assert isinstance(message, Interaction)
        event_id = message.event_id
        if event_id is None:
            refused.append(f"{where}.interaction must have an event_id")
        elif event_id.startswith("script-"):
            refused.append(
                f"{where}.interaction.event_id {show(event_id)}: ids script-<n> are "
                f"reserved for extra_params.{CAMERA_SCRIPT_PARAM}"
            )
        elif event_id in seen:
            refused.append(
                f"{where}.interaction.event_id {show(event_id)} is already used by "
                f"{_SCRIPT_WHERE}[{seen[event_id]}]"
            )
        elif message.camera is not None and camera_scripted:
            refused.append(
                f"{where}.interaction has a camera, but this session's camera follows "
                f"extra_params.{CAMERA_SCRIPT_PARAM}"
            )
        else:
            seen[event_id] = index
            entries.append(
                ScriptedInteraction(
                    chunk, event_id, message.prompt, message.transition_chunks, message.camera
                )
            )
    if refused:
        problems.extend(refused[:_MAX_SCRIPT_PROBLEMS])
        if len(refused) > _MAX_SCRIPT_PROBLEMS:
            problems.append(
                f"{_SCRIPT_WHERE}: {len(refused) - _MAX_SCRIPT_PROBLEMS} more bad entries"
            )
        return ()
    return tuple(sorted(entries, key=lambda entry: entry.chunk_index))

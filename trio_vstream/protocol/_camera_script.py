"""``extra_params.camera_action_script``: a request-scoped WASD script, one entry per chunk.

The format is vllm-omni's, exactly: its LingBot World 2.0 recipe
(``recipes/Robbyant/LingBot-World-2.0.md``, "Streaming video serving") and validator
(``parse_lingbot_camera_action_script`` in
``vllm_omni/diffusion/models/lingbot_world/actions.py``, commit
9a1e1026c038805e8fbd5e91ef571ad2f01ce451) take a non-empty array with one entry per
generated chunk, each entry exactly three per-latent-frame key lists (one LingBot AR
block), each key one of ``w a s d i j k l`` (any case, repeats collapse)::

    "extra_params": {"camera_action_script": [[["w"], ["w"], ["w"]], [["a"], [], []]]}

So a script written for vllm-omni runs here unchanged. Keys never reach an engine (the
recipe: "WASD key tokens belong in clients"): each chunk's key states become one
``velocity`` `Camera` (`key_velocity`, their mean motion per step), which the session
hands the engine at that chunk's boundary, the way a live camera interaction arrives.
A chunk without keys (``[[], [], []]``) is a still camera, not "no change": it stops
the motion. vllm-omni pads an exhausted script with such neutral frames, so a script
whose last chunk moves gets one more, still, entry after it.

Pure and strict like the rest of the package: every refusal names the path of the
offending entry (``extra_params.camera_action_script[3][1][0]``).
"""

from typing import Any, Final

import attrs

from trio_vstream.protocol._camera_keys import CAMERA_KEYS, key_velocity
from trio_vstream.protocol._wire import quote, show
from trio_vstream.values import Camera

__all__ = ["CAMERA_SCRIPT_PARAM", "FRAMES_PER_SCRIPT_CHUNK", "ScriptedCamera", "camera_script_of"]

CAMERA_SCRIPT_PARAM: Final = "camera_action_script"
"""The ``extra_params`` key; the server applies it and never passes it to an engine."""

FRAMES_PER_SCRIPT_CHUNK: Final = 3
"""Key lists per script entry: vllm-omni's ``frames_per_chunk=3`` (one LingBot block of
three latent frames). Kept although our engines' chunks are not LingBot blocks, so that
a script this server accepts is one vllm-omni accepts too."""

_WHERE: Final = f"extra_params.{CAMERA_SCRIPT_PARAM}"
_KEY_LIST: Final = ", ".join(quote(key) for key in CAMERA_KEYS)
_STILL: Final = key_velocity([()])
#: Bad entries named one by one; the rest are counted, so the error stays readable.
_MAX_REPORTED: Final = 10


@attrs.frozen
class ScriptedCamera:
    """One entry of a camera script, resolved: the camera to apply from ``chunk_index``."""

    chunk_index: int
    """The generation chunk (0-based) before which the session hands over ``camera``."""
    camera: Camera
    keys: tuple[tuple[str, ...], ...]
    """The entry's key states as sent (lower case, in vllm-omni's key order; empty for
    the still entry after a moving script), kept for logs and tests."""


def _frame_keys(value: Any, where: str) -> tuple[str, ...] | str:
    """One latent frame's keys, or the problem with them."""
    if not isinstance(value, list):
        return f"{where} must be an array of keys ({_KEY_LIST}), got {show(value)}"
    keys = set()
    for index, item in enumerate(value):
        key = item.lower() if isinstance(item, str) else None
        if key not in CAMERA_KEYS:
            return f"{where}[{index}] must be one of {_KEY_LIST}, got {show(item)}"
        keys.add(key)
    return tuple(key for key in CAMERA_KEYS if key in keys)


def _entry(value: Any, where: str) -> tuple[tuple[str, ...], ...] | str:
    """One chunk's key lists, or the first problem with them."""
    if not isinstance(value, list) or len(value) != FRAMES_PER_SCRIPT_CHUNK:
        got = f"{len(value)}" if isinstance(value, list) else show(value)
        return (
            f"{where} must be an array of {FRAMES_PER_SCRIPT_CHUNK} per-latent-frame key "
            f"lists (one LingBot block), got {got}"
        )
    frames = []
    for index, frame in enumerate(value):
        keys = _frame_keys(frame, f"{where}[{index}]")
        if isinstance(keys, str):
            return keys
        frames.append(keys)
    return tuple(frames)


def camera_script_of(
    extra_params: dict[str, Any] | None, num_frames: int | None, problems: list[str]
) -> tuple[ScriptedCamera, ...]:
    """The request's camera script, one `ScriptedCamera` per chunk (empty: no script).

    The number of chunks is the engine's affair (vllm-omni derives it from LingBot's
    block size), so a script may be shorter than the video (the rest is still) or
    longer (entries after the last chunk are never applied). Only a script with more
    entries than the video has frames (``num_frames``, when known) is refused: no
    engine makes chunks of no frames, so that script is a client bug.

    Every bad entry is reported by its path (the first ten; the rest are counted), not
    only the first, so that a client fixing a long script sees all of it at once.
    """
    if not extra_params or CAMERA_SCRIPT_PARAM not in extra_params:
        return ()
    script = extra_params[CAMERA_SCRIPT_PARAM]
    if not isinstance(script, list) or not script:
        got = "an empty array" if script == [] else show(script)
        problems.append(f"{_WHERE} must be a non-empty array with one entry per chunk, got {got}")
        return ()
    if num_frames is not None and len(script) > num_frames:
        problems.append(
            f"{_WHERE} has {len(script)} entries (one per chunk) but the video has only "
            f"{num_frames} frames"
        )
        return ()
    entries: list[tuple[tuple[str, ...], ...]] = []
    refused: list[str] = []
    for index, value in enumerate(script):
        entry = _entry(value, f"{_WHERE}[{index}]")
        if isinstance(entry, str):
            refused.append(entry)
        else:
            entries.append(entry)
    if refused:
        problems.extend(refused[:_MAX_REPORTED])
        if len(refused) > _MAX_REPORTED:
            problems.append(f"{_WHERE}: {len(refused) - _MAX_REPORTED} more bad entries")
        return ()
    cameras = [ScriptedCamera(i, key_velocity(keys), keys) for i, keys in enumerate(entries)]
    if cameras[-1].camera != _STILL:
        cameras.append(ScriptedCamera(len(entries), _STILL, ()))
    return tuple(cameras)

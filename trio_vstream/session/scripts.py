"""A session's scripted interactions: what the server hands the engine before given chunks.

Two scripts arrive in ``session.start``'s ``extra_params``, both parsed and checked by
the protocol: vllm-omni's ``camera_action_script`` (a camera per chunk) and this
project's ``interaction_script`` (any interaction, at a chunk index: how a recording is
replayed). Both become the `PromptChange` a client could have sent during the chunk
before, queued here by chunk index for the session's generation loop. Pure: no Trio, no
socket, so what a script does is decided (and tested) without a server.
"""

from __future__ import annotations

from collections.abc import Iterable

from trio_vstream import protocol
from trio_vstream.engines.contract import PromptChange


class ScriptRefused(Exception):
    """The engine cannot take what a script holds; the message says what and why."""


def kinds_refusal(kinds: Iterable[str], takes: frozenset[str]) -> str | None:
    """Why an engine that ``takes`` these interaction kinds refuses ``kinds``, or None."""
    refused = sorted(set(kinds) - takes)
    if not refused:
        return None
    return (
        f"this engine takes no {' or '.join(refused)} interactions "
        f"(it takes: {', '.join(sorted(takes)) or 'none'})"
    )


class Scripts:
    """The scripted changes of one session, by the chunk they go before.

    Built once the request is valid, against the engine's interaction kinds: an engine
    that cannot take what a script holds refuses the start (silently dropping the script
    would make a different video). The scripts' event ids are reserved for the session,
    so a client interaction reusing one gets ``event_id_conflict``; the camera script's
    are ``script-<chunk index>``, which the ids minted for clients (uuid hex) never are.
    """

    def __init__(self) -> None:
        """No scripts (`from_start` reads a request's)."""
        self._by_chunk: dict[int, list[PromptChange]] = {}
        self.event_ids: set[str] = set()
        """The ids the scripts use, reserved for the session."""
        self.owns_camera = False
        """As in vllm-omni, a camera script owns the camera: live cameras are refused."""

    @classmethod
    def from_start(cls, start: protocol.SessionStart, takes: frozenset[str]) -> Scripts:
        """The scripts of a valid ``session.start``, for an engine that ``takes`` these
        interaction kinds; `ScriptRefused` when it cannot take what they hold."""
        self = cls()
        self.owns_camera = bool(start.camera_script)
        # Interactions first: a live one for chunk k arrived while chunk k-1 was being
        # generated, before the camera script's entry for k, and replays keep that order.
        for entry in start.interaction_script:
            change = PromptChange(
                entry.event_id, entry.prompt, entry.transition_chunks, entry.camera
            )
            refusal = kinds_refusal(change.kinds, takes)
            if refusal is not None:
                raise ScriptRefused(f"extra_params.{protocol.INTERACTION_SCRIPT_PARAM}: {refusal}")
            self._add(entry.chunk_index, change)
        if start.camera_script:
            refusal = kinds_refusal({"camera"}, takes)
            if refusal is not None:
                raise ScriptRefused(f"extra_params.{protocol.CAMERA_SCRIPT_PARAM}: {refusal}")
        for camera in start.camera_script:
            index = camera.chunk_index
            self._add(index, PromptChange(f"script-{index}", None, 0, camera.camera))
        return self

    def _add(self, chunk_index: int, change: PromptChange) -> None:
        self.event_ids.add(change.event_id)
        self._by_chunk.setdefault(chunk_index, []).append(change)

    def before_chunk(self, index: int) -> list[PromptChange]:
        """The changes to hand the engine right before generating chunk ``index``, once."""
        return self._by_chunk.pop(index, [])

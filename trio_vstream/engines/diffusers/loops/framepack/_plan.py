"""FramePack's sections: what a request asks for (`framepack_plan`: the sampling, the
window, the schedule), checked before the stream starts (`FramepackPlan`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from trio_vstream.engines.diffusers._messages import quoted, shown

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers._loading import PipelineInfo


HISTORY_SIZES: tuple[int, int, int] = (16, 2, 1)
"""The vanilla history's 4x, 2x and 1x latent frames (the call's, fixed for F1)."""

VANILLA = "vanilla"
"""FramePack-F1's sampling: streamed section by section (`FramepackLoop`)."""
INVERTED = "inverted_anti_drifting"
"""The call's default sampling (FramePackI2V_HY's): served segment by segment."""
SAMPLING_TYPES: tuple[str, ...] = (INVERTED, VANILLA)
"""The ``sampling_type`` values a request may ask for."""


@attrs.frozen(kw_only=True)
class FramepackPlan:
    """The section loop's shape, as the call works it out from its arguments."""

    window: int
    """``latent_window_size``: latent frames per section (4 frames each)."""
    sections: int
    """The call's ``num_latent_sections`` for the whole video (the vanilla loop's count)."""
    sigmas: tuple[float, ...] | None = None
    true_cfg_scale: float = 1.0
    sampling: str = VANILLA
    """``sampling_type``: `VANILLA` (`FramepackLoop`) or `INVERTED` (the segment path)."""

    @property
    def inverted(self) -> bool:
        """Whether the video is served segment by segment, one inverted call a segment."""
        return self.sampling == INVERTED

    def segment_frames(self, temporal: int) -> int:
        """Frames one inverted call of one section makes: the conditioning image's frame
        (the prepended image latent, decoded), then ``temporal`` per latent frame."""
        return self.window * temporal + 1

    def call_frames(self, temporal: int) -> int:
        """The most ``num_frames`` an inverted call is asked for: the call runs
        ``ceil(num_frames / ((window-1)*temporal+1))`` sections, so this is one section."""
        return (self.window - 1) * temporal + 1

    def call_kwargs(self) -> dict[str, Any]:
        """What every inverted segment's call is given besides the request's arguments:
        the sampling (explicitly, not left to the call's default) and the window the
        segment's frames were counted with."""
        return {"sampling_type": self.sampling, "latent_window_size": self.window}

    @property
    def overlap(self) -> int:
        """Frames each section is cross-faded over (the call's ``overlapped_frames``)."""
        return (self.window - 1) * 4 + 1

    @property
    def kept_latents(self) -> int:
        """Latent frames of history a session keeps: the next section's context and the
        next decode's two sections."""
        return max(sum(HISTORY_SIZES), 2 * self.window)


def framepack_plan(
    info: PipelineInfo,
    extra: Mapping[str, Any],
    *,
    num_frames: int,
    window: int,
    true_cfg_scale: float | None,
    problems: list[str],
) -> FramepackPlan | None:
    """The sections a request asks for. ``sampling_type`` (else the call's default,
    ``"inverted_anti_drifting"``) must be one of `SAMPLING_TYPES`: ``"vanilla"`` is
    streamed section by section, ``"inverted_anti_drifting"`` segment by segment.
    ``latent_window_size`` (else ``window``, the engine's) and ``sigmas`` may come in
    ``extra_params``. Appends what is wrong to ``problems`` (then returns None), so a bad
    request is refused before it runs."""
    sampling = extra.get("sampling_type", info.default("sampling_type") or INVERTED)
    sampling = getattr(sampling, "value", sampling)  # the call's default is an enum
    known = isinstance(sampling, str) and sampling in SAMPLING_TYPES
    if not known:
        accepted = " or ".join(repr(v) for v in SAMPLING_TYPES)
        problems.append(
            f"extra_params.sampling_type must be {accepted} for {info.class_name} "
            f"(inverted_anti_drifting, the call's default, is served segment by segment; "
            f"vanilla, FramePack-F1, section by section), got {quoted(sampling)}"
        )
    size = extra.get("latent_window_size", window)
    # A section is latent_window_size latent frames, made in one go whatever num_frames:
    # up to the engine's own window, or to the video's length if that is longer.
    largest = max(window, (num_frames + 3) // 4)
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= largest:
        problems.append(
            f"extra_params.latent_window_size must be an integer from 1 to {largest} (the "
            f"engine's window, or the video's latent frames), got {shown(size)}"
        )
        return None
    # sigmas comes checked (`check_extra_params`): bounded, one per step.
    schedule = extra.get("sigmas")
    if schedule is not None:
        schedule = tuple(schedule)
    if not known:
        return None
    window_frames = (size - 1) * 4 + 1
    return FramepackPlan(
        window=size,
        sections=max(1, (num_frames + window_frames - 1) // window_frames),
        sigmas=schedule,
        true_cfg_scale=1.0 if true_cfg_scale is None else float(true_cfg_scale),
        sampling=sampling,
    )

"""The diffusion-forcing window loop's shape: what a request asks for (`window_plan`),
checked before the stream starts, as the call works it out (`WindowPlan`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from trio_vstream.engines.diffusers._extra import MAX_STEPS
from trio_vstream.engines.diffusers._loading import valid_frames
from trio_vstream.engines.diffusers._messages import shown
from trio_vstream.engines.diffusers.loops._protocol import Draft

if TYPE_CHECKING:
    pass


DEFAULT_OVERLAP_HISTORY = 17
"""Overlap frames when a request gives none: the call requires one for long videos and
recommends 17 or 37."""


@attrs.frozen(kw_only=True)
class WindowPlan:
    """The window loop's shape, as the call works it out from its arguments (in latent
    frames: the VAE makes ``temporal`` frames of each but the first)."""

    latent_frames: int
    """The whole video's."""
    base: int
    """Latent frames per window (``base_num_frames``'s)."""
    overlap: int
    """Latent frames each window after the first starts from (0: one window)."""
    causal_block_size: int | None
    """None: the transformer's own ``num_frame_per_block``."""
    ar_step: int
    addnoise_condition: float

    @classmethod
    def of(
        cls,
        *,
        num_frames: int,
        base_num_frames: int,
        overlap_history: int,
        temporal: int,
        causal_block_size: int | None,
        ar_step: int,
        addnoise_condition: float,
    ) -> WindowPlan:
        """The plan of a call with these arguments (``num_frames`` already ``temporal*n+1``)."""
        latent_frames = (num_frames - 1) // temporal + 1
        if num_frames > base_num_frames:  # the call's is_long_video
            base = (base_num_frames - 1) // temporal + 1
            overlap = (overlap_history - 1) // temporal + 1
        else:
            base, overlap = latent_frames, 0
        return cls(
            latent_frames=latent_frames,
            base=base,
            overlap=overlap,
            causal_block_size=causal_block_size,
            ar_step=ar_step,
            addnoise_condition=addnoise_condition,
        )

    @property
    def windows(self) -> int:
        """How many windows the call runs (its ``n_iter``)."""
        if self.overlap == 0:
            return 1
        return 1 + (self.latent_frames - self.base - 1) // (self.base - self.overlap) + 1

    def window_latent_frames(self, index: int) -> int:
        """Latent frames in window ``index``, its prefix included (the call's
        ``prepare_latents``: the last window is what is left)."""
        if index == 0:
            return self.base
        finished = index * (self.base - self.overlap) + self.overlap
        return min(self.latent_frames - finished + self.overlap, self.base)


def window_plan(draft: Draft) -> WindowPlan | None:
    """The window loop a request asks for: ``base_num_frames`` (the engine's
    ``segment_frames``), ``overlap_history`` (17, or about half a window for windows of 21
    frames or fewer), ``ar_step``, ``causal_block_size`` and ``addnoise_condition`` may come
    in ``extra_params``, as for the call. Appends what is wrong to ``draft.problems`` (then
    returns None), so a bad request is refused before it runs, not mid-video."""
    info, extra, problems, temporal = draft.model, draft.extra, draft.problems, draft.frame_step
    num_frames = valid_frames(draft.request.num_frames, temporal)
    base_num_frames = draft.segment_frames

    def whole(name: str, default: Any, minimum: int, maximum: int | None = None) -> Any:
        value = extra.get(name, default)
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < minimum
            or (maximum is not None and value > maximum)
        ):
            bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            problems.append(f"extra_params.{name} must be an integer {bound}, got {shown(value)}")
            return default
        return value

    # base_num_frames, overlap_history and causal_block_size need no upper bound of their
    # own: a window is never longer than the video (num_frames, which the server bounds),
    # the overlap is less than the window and a block divides it (both checked below).
    base = whole("base_num_frames", base_num_frames, 2 * temporal + 1)
    if (base - 1) % temporal:
        problems.append(f"extra_params.base_num_frames must be {temporal}*n+1, got {base}")
        return None
    half = ((base - 1) // temporal // 2) * temporal + 1
    overlap = whole("overlap_history", min(DEFAULT_OVERLAP_HISTORY, half), 1)
    # A lag beyond the schedule's length adds no work (a block waits at most until the
    # one before it is done), but a number beyond any schedule is a mistake.
    ar_step = whole("ar_step", 0, 0, MAX_STEPS)
    block = whole("causal_block_size", None, 1)
    noise = extra.get("addnoise_condition", 0)
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not 0 <= noise <= 1000:
        problems.append(f"extra_params.addnoise_condition must be in 0..1000, got {shown(noise)}")
        noise = 0
    if overlap >= base:
        problems.append(
            f"extra_params.overlap_history ({overlap}) must be less than the window "
            f"(base_num_frames, {base})"
        )
        return None
    plan = WindowPlan.of(
        num_frames=num_frames,
        base_num_frames=base,
        overlap_history=overlap,
        temporal=temporal,
        causal_block_size=block,
        ar_step=ar_step,
        addnoise_condition=float(noise),
    )
    own = getattr(getattr(info.pipe, "transformer", None), "config", None)
    size = block if block is not None else int(getattr(own, "num_frame_per_block", 1) or 1)
    uneven = [
        plan.window_latent_frames(i)
        for i in range(plan.windows)
        if plan.window_latent_frames(i) % size
    ]
    if uneven:
        problems.append(
            f"every window must be a whole number of causal blocks ({size} latent frames); "
            f"this length makes windows of {uneven[0]}: change num_frames or base_num_frames"
        )
        return None
    return plan

"""FAR's chunk plan: the chunk partition a request asks for (`far_plan`), checked
before the stream starts, in latent frames (`FarPlan`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from trio_vstream.engines.diffusers._loading import valid_frames
from trio_vstream.engines.diffusers._messages import shown
from trio_vstream.engines.diffusers.loops._protocol import Draft

if TYPE_CHECKING:
    pass


def chunk_latent_frames(pipe: Any) -> int:
    """Latent frames per chunk when a request gives no ``chunk_partition``: the most
    common chunk after the first in the transformer's own partition (3 for the released
    checkpoints' ``(1, 3, 3, 3, 3, 3, 3, 2)``)."""
    own = list(getattr(pipe.transformer.config, "chunk_partition", None) or (1, 3))
    rest = own[1:] or own
    return max(set(rest), key=rest.count)


@attrs.frozen(kw_only=True)
class FarPlan:
    """The chunk loop's shape, in latent frames (the VAE makes 4 frames of each but the
    video's first)."""

    partition: tuple[int, ...]
    """Latent frames per chunk; sums to the video's latent frames."""
    use_mean_velocity: bool = True
    sigmas: tuple[float, ...] | None = None
    timesteps: tuple[float, ...] | None = None

    @property
    def chunks(self) -> int:
        return len(self.partition)

    def bounds(self, index: int) -> tuple[int, int]:
        """Latent frames ``[start, end)`` of chunk ``index``."""
        start = sum(self.partition[:index])
        return start, start + self.partition[index]


def far_plan(draft: Draft) -> FarPlan | None:
    """The chunk loop a request asks for: ``chunk_partition`` from ``extra_params`` (it
    must sum to the video's latent frames, as for the call), else the first chunk of the
    transformer's own partition followed by chunks of ``segment_frames`` (in latent
    frames), the last one what is left. Appends what is wrong to ``draft.problems`` (then
    returns None), so a bad request is refused before it runs."""
    info, extra, problems, temporal = draft.model, draft.extra, draft.problems, draft.frame_step
    num_frames = valid_frames(draft.request.num_frames, temporal)
    chunk = draft.segment_frames // temporal
    image = draft.request.image is not None
    latent_frames = (num_frames - 1) // temporal + 1
    given = extra.get("chunk_partition")
    if given is not None:
        if (
            not isinstance(given, (list, tuple))
            or not given
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in given)
        ):
            problems.append(
                "extra_params.chunk_partition must be a list of positive integers, got "
                f"{shown(given)}"
            )
            return None
        partition = tuple(int(n) for n in given)
        if sum(partition) != latent_frames:
            problems.append(
                f"extra_params.chunk_partition sums to {sum(partition)}, but {num_frames} frames "
                f"are {latent_frames} latent frames"
            )
            return None
    else:
        own = list(getattr(info.pipe.transformer.config, "chunk_partition", None) or (1,))
        first = min(int(own[0]), latent_frames)
        left = latent_frames - first
        partition = (first, *([chunk] * (left // chunk)), *([left % chunk] if left % chunk else []))
    if image and partition[0] != 1:
        problems.append(
            "image_reference is the first latent frame: chunk_partition must start with 1, "
            f"got {list(partition)}"
        )
    mean_velocity = extra.get("use_mean_velocity", True)
    if not isinstance(mean_velocity, bool):
        problems.append(
            f"extra_params.use_mean_velocity must be true or false, got {shown(mean_velocity)}"
        )
        mean_velocity = True
    # sigmas and timesteps come checked (`check_extra_params`): bounded, one per step.
    schedules = {name: extra.get(name) for name in ("sigmas", "timesteps")}
    return FarPlan(
        partition=partition,
        use_mean_velocity=mean_velocity,
        sigmas=tuple(schedules["sigmas"]) if schedules["sigmas"] is not None else None,
        timesteps=tuple(schedules["timesteps"]) if schedules["timesteps"] is not None else None,
    )

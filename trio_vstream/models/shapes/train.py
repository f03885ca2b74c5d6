"""Train the shapes model: ``python -m trio_vstream.models.shapes.train``.

Data is rendered on the fly by :mod:`render` from a seeded generator, so a
run needs no data set and the same seed and step count give the same batches.
Each example is one chunk: a context frame (the last frame of a "previous
chunk", sometimes with other attributes, sometimes noisy, sometimes absent)
and the next ``chunk_frames`` frames of the object moving on from there with
the prompt's attributes. What the tricks are for:

* context dropout: chunk 0 (no context) and image-to-video are the same model;
  without a context, a blob marks where the object starts (the engine draws
  that position from the seed);
* attribute changes between context and chunk: the prompt, not the context,
  decides colour, shape, size and background, which is what lets an
  interaction take effect while the position carries on;
* context noise: at inference the context is the model's own output, not a
  perfect render; noise keeps small errors from compounding over chunks;
* condition dropout (whole prompt, or single slots): classifier-free
  guidance, and negative prompts that name only some slots;
* blended prompts: the conditioning is sometimes a mix of two prompt
  embeddings with the object colour mixed in the same proportion, which is
  what a prompt transition feeds the model.

The loss is the MSE on the clean chunk, the object and a ring around it
weighted ``OBJECT_WEIGHT`` times (they are a few percent of the picture but
all of its content, and halos there are what shows at chunk boundaries), the
first and last frames more than the others (they meet the neighbouring
chunks), and a third of the examples are at t = 1, where the few-step
sampler's first step decides the picture.

Training stops at ``--steps`` or at ``--minutes`` of wall time, whichever
comes first; the learning rate follows the further along of the two, so a
time-capped run still anneals. The EMA of the weights is saved (float16
safetensors, config in the metadata), with a JSON of settings and final
metrics next to it. The quality check runs the engine, which this package does
not know: ``python bench/shapes_in_process.py --weights OUT --record`` adds its
numbers to that JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import TypedDict

import attrs
import torch
from torch.nn import functional as F

from trio_vstream.models.shapes.model import (
    ModelConfig,
    ShapesDenoiser,
    parameter_count,
    save_weights,
    slot_vectors,
)
from trio_vstream.models.shapes.render import (
    SIZE_RADII,
    motion_tensor,
    palette_tensor,
    position_hint,
    render,
)
from trio_vstream.models.shapes.vocab import BACKGROUND_NAMES, COLOUR_NAMES, SLOT_NAMES

DEFAULT_OUT = Path(__file__).with_name("weights.safetensors")
OBJECT_WEIGHT = 8.0
_WHITE_OBJECT = COLOUR_NAMES.index("white")
_WHITE_BACKGROUND = BACKGROUND_NAMES.index("white")


@attrs.frozen(kw_only=True)
class TrainSettings:
    seed: int = 0
    steps: int = 100_000
    """An upper bound: the shipped run is time-bound (``minutes``)."""
    minutes: float = 56.0
    batch: int = 32
    lr: float = 1e-3
    warmup: int = 200
    ema: float = 0.999
    threads: int = 2
    p_context_drop: float = 0.2
    p_prompt_drop: float = 0.1
    p_slot_drop: float = 0.05
    p_blend: float = 0.1
    p_change_colour: float = 0.25
    p_change_other: float = 0.1
    context_noise: float = 0.05
    channels: tuple[int, ...] = (64, 128, 192)
    blocks: int = 1
    patch: int = 2
    context_skip: bool = True
    halo: int = 2
    end_weight: float = 2.0
    """Loss weight of a chunk's first and last frames, relative to the others."""
    """Width in native pixels of the ring around the object weighted like the object."""


def _avoid_white_on_white(
    colour: torch.Tensor, background: torch.Tensor, gen: torch.Generator
) -> torch.Tensor:
    """Backgrounds are never the object's colour: move white-on-white to another background."""
    other = torch.randint(0, len(BACKGROUND_NAMES) - 1, colour.shape, generator=gen)
    other = other + (other >= _WHITE_BACKGROUND).long()
    return torch.where(
        (colour == _WHITE_OBJECT) & (background == _WHITE_BACKGROUND), other, background
    )


class Batch(TypedDict):
    """One batch of chunks (`make_batch`), batch dimension first."""

    weight: torch.Tensor
    target: torch.Tensor
    context: torch.Tensor
    context_mask: torch.Tensor
    hint: torch.Tensor
    slots_a: dict[str, torch.Tensor]
    slots_b: dict[str, torch.Tensor]
    blend: torch.Tensor


def make_batch(gen: torch.Generator, settings: TrainSettings, config: ModelConfig) -> Batch:
    """One batch of chunks, on the CPU, from ``gen`` only."""
    b = settings.batch
    size = config.native_size
    frames = config.chunk_frames

    def randint(high: int) -> torch.Tensor:
        return torch.randint(0, high, (b,), generator=gen)

    def chance(p: float) -> torch.Tensor:
        return torch.rand(b, generator=gen) < p

    n_colours = len(COLOUR_NAMES)
    colour, shape, motion = randint(n_colours), randint(3), randint(5)
    background = _avoid_white_on_white(colour, randint(len(BACKGROUND_NAMES)), gen)
    size_index = randint(2)
    colour_b = (colour + 1 + randint(n_colours - 1)) % n_colours
    blend = torch.where(chance(settings.p_blend), torch.rand(b, generator=gen), torch.zeros(b))

    prev_colour = torch.where(
        chance(settings.p_change_colour), (colour + 1 + randint(n_colours - 1)) % n_colours, colour
    )
    prev_shape = torch.where(chance(settings.p_change_other), randint(3), shape)
    prev_size = torch.where(chance(settings.p_change_other), randint(2), size_index)
    prev_background = torch.where(
        chance(settings.p_change_other), randint(len(BACKGROUND_NAMES)), background
    )
    prev_background = _avoid_white_on_white(prev_colour, prev_background, gen)

    colours = palette_tensor("colour")
    backgrounds = palette_tensor("background")
    radii = torch.tensor(SIZE_RADII) * size / 32.0
    velocity = motion_tensor()[motion]
    x0 = torch.rand(b, generator=gen) * size
    y0 = torch.rand(b, generator=gen) * size
    steps = torch.arange(1, frames + 1, dtype=torch.float32)
    cx = x0[:, None] + velocity[:, 0:1] * steps
    cy = y0[:, None] + velocity[:, 1:2] * steps
    target_rgb = torch.lerp(colours[colour], colours[colour_b], blend[:, None])
    target = render(target_rgb, backgrounds[background], shape, radii[size_index], cx, cy, size)
    context = render(
        colours[prev_colour],
        backgrounds[prev_background],
        prev_shape,
        radii[prev_size],
        x0[:, None],
        y0[:, None],
        size,
    )[:, 0]
    was_object = (context - backgrounds[prev_background].view(b, 3, 1, 1)).abs().amax(1) > 0.02
    sigma = torch.rand(b, 1, 1, 1, generator=gen) * settings.context_noise
    context = context + sigma * torch.randn(context.shape, generator=gen)

    drop_all = chance(settings.p_prompt_drop)
    indices_a = {"colour": colour, "shape": shape, "motion": motion}
    indices_a |= {"background": background, "size": size_index}
    for name in SLOT_NAMES:
        dropped = drop_all | chance(settings.p_slot_drop)
        indices_a[name] = torch.where(
            dropped, torch.full_like(indices_a[name], -1), indices_a[name]
        )
    indices_b = dict(indices_a)
    indices_b["colour"] = torch.where(indices_a["colour"] < 0, indices_a["colour"], colour_b)
    context_mask = (~chance(settings.p_context_drop)).float()
    # Without a context, the start position comes as a hint (almost always: the
    # engine always gives one; the rest keeps hint-less generation possible).
    with_hint = (context_mask == 0) & chance(0.9)
    hint = position_hint(x0, y0, size) * with_hint.float().view(-1, 1, 1, 1)
    # The object covers a few percent of the pixels but is what matters: its
    # pixels, a ring of ``halo`` pixels around it, and where it was in the
    # context (which must be erased) weigh OBJECT_WEIGHT times more in the loss.
    # Without the ring, faint halos around the object cost almost nothing and
    # change from chunk to chunk, which is a visible pulse at every boundary.
    on_object = (target - backgrounds[background].view(b, 1, 3, 1, 1)).abs().amax(2) > 0.02
    was_object = was_object & (context_mask.view(b, 1, 1) > 0)
    near = (on_object | was_object[:, None]).float()
    if settings.halo > 0:
        near = F.max_pool2d(
            F.pad(near, (settings.halo,) * 4, mode="circular"), 2 * settings.halo + 1, stride=1
        )
    weight = 1.0 + (OBJECT_WEIGHT - 1.0) * near.repeat_interleave(3, dim=1)
    # The first and last frames of a chunk meet the neighbouring chunks: an
    # error there is a jump at a boundary, so they weigh more.
    ends = torch.ones(frames)
    ends[0] = ends[-1] = settings.end_weight
    weight = weight * ends.repeat_interleave(3).view(1, 3 * frames, 1, 1)
    return {
        "weight": weight,
        "target": (target.reshape(b, 3 * frames, size, size) * 2.0 - 1.0),
        "context": context * 2.0 - 1.0,
        "context_mask": context_mask,
        "hint": hint,
        "slots_a": slot_vectors(indices_a),
        "slots_b": slot_vectors(indices_b),
        "blend": blend,
    }


def _sample_t(gen: torch.Generator, batch: int) -> torch.Tensor:
    """Noise levels: 30% t = 1, 30% the 4-step sampler's other times, 40% uniform.

    The few-step sampler decides almost everything at its first step, from
    pure noise (t = 1), where the model must draw the whole chunk from the
    context and the prompt alone; a uniform t would rarely train that case.
    """
    uniform = torch.rand(batch, generator=gen).clamp(1e-3, 1.0)
    grid = torch.tensor([0.75, 0.5, 0.25])[torch.randint(0, 3, (batch,), generator=gen)]
    pick = torch.rand(batch, generator=gen)
    return torch.where(pick < 0.3, torch.ones(batch), torch.where(pick < 0.6, grid, uniform))


def _lr_factor(progress: float, step: int, warmup: int) -> float:
    warm = min(1.0, (step + 1) / warmup)
    return warm * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def _format_seconds(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60:d}:{seconds % 60:02d}"


def train(
    settings: TrainSettings,
    out: Path,
    *,
    snapshot: Path | None = None,
    snapshot_minutes: float = 10.0,
) -> dict[str, object]:
    """Run training; write ``out`` and ``out.with_suffix('.json')``; return the JSON."""
    torch.set_num_threads(settings.threads)
    torch.manual_seed(settings.seed)
    config = ModelConfig(
        channels=settings.channels,
        blocks=settings.blocks,
        patch=settings.patch,
        context_skip=settings.context_skip,
    )
    model = ShapesDenoiser(config)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    params = parameter_count(model)
    print(f"shapes model: {params:,} parameters; {settings}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(settings.seed)
    budget = settings.minutes * 60.0
    start = time.monotonic()
    losses: list[float] = []
    out.parent.mkdir(parents=True, exist_ok=True)
    if snapshot is not None:
        snapshot.parent.mkdir(parents=True, exist_ok=True)
    step = 0
    progress = 0.0
    next_snapshot = snapshot_minutes * 60.0
    while progress < 1.0:
        batch = make_batch(gen, settings, config)
        target = batch["target"]
        t = _sample_t(gen, settings.batch)
        noise = torch.randn(target.shape, generator=gen)
        tb = t.view(-1, 1, 1, 1)
        x_t = (1.0 - tb) * target + tb * noise
        blend = batch["blend"].view(-1, 1)
        cond = torch.lerp(model.embed(batch["slots_a"]), model.embed(batch["slots_b"]), blend)
        predicted = model(x_t, t, batch["context"], batch["context_mask"], cond, batch["hint"])
        weight = batch["weight"]
        loss = (weight * (predicted - target).square()).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elapsed = time.monotonic() - start
        progress = max((step + 1) / settings.steps, elapsed / budget)
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * _lr_factor(progress, step, settings.warmup)
        optimizer.step()
        decay = min(settings.ema, (1.0 + step) / (10.0 + step))
        with torch.no_grad():
            for p_ema, p in zip(ema.parameters(), model.parameters(), strict=True):
                p_ema.lerp_(p, 1.0 - decay)
        losses.append(loss.item())
        step += 1
        if snapshot is not None and elapsed >= next_snapshot:
            save_weights(ema, snapshot)
            next_snapshot += snapshot_minutes * 60.0
            print(f"snapshot at step {step}: {snapshot}", flush=True)
        if step % 50 == 0 or progress >= 1.0:
            recent = sum(losses[-50:]) / len(losses[-50:])
            rate = step * settings.batch / elapsed
            eta = elapsed / max(progress, 1e-9) - elapsed
            print(
                f"step {step}/{settings.steps} loss {recent:.4f} "
                f"{rate:.0f} samples/s elapsed {_format_seconds(elapsed)} "
                f"eta {_format_seconds(eta)}",
                flush=True,
            )
    wall = time.monotonic() - start
    save_weights(ema, out)
    report: dict[str, object] = {
        "settings": attrs.asdict(settings),
        "model_config": attrs.asdict(config),
        "parameters": params,
        "steps_done": step,
        "samples_seen": step * settings.batch,
        "train_seconds": round(wall, 1),
        "final_loss": round(sum(losses[-200:]) / len(losses[-200:]), 5),
        "torch": torch.__version__,
        "device": "cpu",
    }
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2), flush=True)
    # The model package knows nothing of engines; the check that runs one lives above.
    print(
        f"quick check: python bench/shapes_in_process.py --weights {out} --split tune --record",
        flush=True,
    )
    return report


def main(argv: list[str] | None = None) -> int:
    defaults = TrainSettings()
    parser = argparse.ArgumentParser(
        prog="python -m trio_vstream.models.shapes.train",
        description="Train the shapes video diffusion model on procedurally rendered chunks.",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="weights file to write")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--minutes", type=float, default=defaults.minutes, help="wall-clock budget")
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument(
        "--channels",
        type=lambda s: tuple(int(c) for c in s.split(",")),
        default=defaults.channels,
        help="UNet widths per level, e.g. 48,96,144",
    )
    parser.add_argument("--blocks", type=int, default=defaults.blocks)
    parser.add_argument("--patch", type=int, default=defaults.patch)
    parser.add_argument(
        "--halo",
        type=int,
        default=defaults.halo,
        help="ring around the object, in native pixels, weighted like the object in the loss",
    )
    parser.add_argument(
        "--end-weight",
        type=float,
        default=defaults.end_weight,
        help="loss weight of a chunk's first and last frames (they meet other chunks)",
    )
    parser.add_argument(
        "--context-skip",
        action=argparse.BooleanOptionalAction,
        default=defaults.context_skip,
        help="predict each frame as the context frame plus a change (default: on)",
    )
    parser.add_argument(
        "--snapshot",
        type=Path,
        default=None,
        help="also write the EMA weights here every --snapshot-minutes, to evaluate mid-run",
    )
    parser.add_argument("--snapshot-minutes", type=float, default=10.0)
    args = parser.parse_args(argv)
    # Every setting with a flag comes from it; the rest keep their defaults.
    settings = TrainSettings(
        **{f.name: getattr(args, f.name) for f in attrs.fields(TrainSettings) if f.name in args}
    )
    train(
        settings,
        args.out,
        snapshot=args.snapshot,
        snapshot_minutes=args.snapshot_minutes,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

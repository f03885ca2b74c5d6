"""The shapes model's evaluator: does the video show what the prompt asked for?

It judges decoded RGB frames only, with simple image analysis and no access
to the renderer's ground truth, so it measures what a viewer would see:

* background: the median colour of the border pixels, nearest background
  palette entry;
* object: the pixels far from the background (more than half of the
  largest distance in the frame, and at least ``MIN_OBJECT_DISTANCE``); its
  colour is their median, nearest object palette entry;
* motion: the object's centroid per frame, taken on the torus (circular
  mean, because the world wraps), unwrapped between frames; the net
  displacement between the first and last four frames gives the direction
  (dominant axis) or "still" when it is under ``STILL_PIXELS`` (scaled to a
  256-pixel frame);
* shape: how the object fills its bounding box (median over frames; the
  frame is rolled so the object is not cut by an edge): a square fills all
  of it, a circle pi/4, the triangle half;
* continuity: mean absolute difference between consecutive frames across a
  chunk boundary, against the same inside chunks.

And how the picture looks (`look`, issue 35), on the same decoded frames:

* split: the object touches two opposite edges of the frame (the world wraps, and an
  object across an edge shows as two pieces);
* edge width: along the row and the column through the object's centre, how many pixels
  the contrast (from the background's colour, 0, to the object's, 1) takes to go from
  90% to 10%, at each of the four edges;
* background noise: the spatial standard deviation of each channel over the background
  pixels away from the object (``NOISE_MARGIN`` of the frame's size).

The prompt sets are generated from the vocabulary with a seed per split:
``tune`` is what the model and its defaults were tuned on, ``eval`` (other
phrasings, other seeds) is what the published numbers use.
This module knows the model's world only (its vocabulary), never an engine or a
server: what produces the frames lives above both. ``bench/shapes_in_process.py``
runs the engine directly (quick, for training and tuning);
``bench/evaluate_shapes.py`` judges video streamed through a real server.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from trio_vstream.models.shapes.vocab import (
    BACKGROUND_NAMES,
    BACKGROUNDS,
    COLOUR_NAMES,
    MOTIONS,
    OBJECT_COLOURS,
    SHAPES,
    Slots,
    parse_prompt,
)

MIN_OBJECT_DISTANCE = 40.0
STILL_PIXELS = 4.0
"""A still object's centroid moves less than this many pixels (in a 256-pixel frame)."""
SQUARE_FILL = 0.89
TRIANGLE_FILL = 0.64
CHUNK_FRAMES = 8

_COLOUR_TABLE = np.array(list(OBJECT_COLOURS.values()), dtype=np.float32)
_BACKGROUND_TABLE = np.array(list(BACKGROUNDS.values()), dtype=np.float32)


@attrs.frozen(kw_only=True)
class ClipAnalysis:
    background: str
    colour: str | None
    """``None`` when no object was found."""
    motion: str | None
    shape: str | None
    displacement: tuple[float, float]
    fill: float
    boundary_diff: float
    """Mean abs difference of consecutive frames across chunk boundaries (NaN if none)."""
    inside_diff: float
    boundary_count: int
    inside_count: int


def _nearest(rgb: np.ndarray, table: np.ndarray, names: Sequence[str]) -> str:
    return names[int(np.argmin(((table - rgb[None]) ** 2).sum(axis=1)))]


def background_colour(frames: np.ndarray) -> np.ndarray:
    """Median RGB of the border pixels of all frames."""
    border = np.concatenate(
        [
            frames[:, 0, :].reshape(-1, 3),
            frames[:, -1, :].reshape(-1, 3),
            frames[:, :, 0].reshape(-1, 3),
            frames[:, :, -1].reshape(-1, 3),
        ]
    )
    return np.median(border.astype(np.float32), axis=0)


def object_mask(frame: np.ndarray, background: np.ndarray) -> np.ndarray:
    distance = np.sqrt(((frame.astype(np.float32) - background) ** 2).sum(axis=-1))
    peak = float(distance.max())
    if peak < MIN_OBJECT_DISTANCE:
        return np.zeros(distance.shape, dtype=bool)
    return distance > max(MIN_OBJECT_DISTANCE, 0.5 * peak)


def _circular_mean(coordinates: np.ndarray, period: int) -> float:
    angles = coordinates * (2.0 * np.pi / period)
    angle = np.arctan2(np.sin(angles).mean(), np.cos(angles).mean())
    return float(angle * period / (2.0 * np.pi)) % period


def _fill_ratio(mask: np.ndarray, cx: float, cy: float) -> float:
    height, width = mask.shape
    rolled = np.roll(mask, (height // 2 - round(cy), width // 2 - round(cx)), axis=(0, 1))
    ys, xs = np.nonzero(rolled)
    box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
    return float(len(ys)) / float(box)


def analyse_clip(frames: np.ndarray, chunk_frames: int = CHUNK_FRAMES) -> ClipAnalysis:
    """Judge one clip of (T, H, W, 3) uint8 frames."""
    count, height, width, _ = frames.shape
    background = background_colour(frames)
    object_pixels = []
    centres: list[tuple[float, float] | None] = []
    fills = []
    for frame in frames:
        mask = object_mask(frame, background)
        if mask.sum() < 4:
            centres.append(None)
            continue
        ys, xs = np.nonzero(mask)
        cx = _circular_mean(xs + 0.5, width)
        cy = _circular_mean(ys + 0.5, height)
        centres.append((cx, cy))
        fills.append(_fill_ratio(mask, cx, cy))
        object_pixels.append(frame[mask])
    colour = shape = motion = None
    displacement = (0.0, 0.0)
    fill = float("nan")
    if object_pixels:
        median = np.median(np.concatenate(object_pixels).astype(np.float32), axis=0)
        colour = _nearest(median, _COLOUR_TABLE, COLOUR_NAMES)
        fill = float(np.median(fills))
        shape = "square" if fill > SQUARE_FILL else "circle" if fill > TRIANGLE_FILL else "triangle"
    found = [(i, c) for i, c in enumerate(centres) if c is not None]
    if len(found) >= 2:
        # Unwrap the track: consecutive detections move less than half the frame.
        track = [np.array(found[0][1])]
        for _, (cx, cy) in found[1:]:
            step = np.array([cx, cy]) - np.array(track[-1]) % np.array([width, height])
            step = (step + np.array([width, height]) / 2) % np.array([width, height]) - (
                np.array([width, height]) / 2
            )
            track.append(track[-1] + step)
        points = np.array(track)
        edge = min(4, max(1, len(points) // 4))
        dx, dy = points[-edge:].mean(axis=0) - points[:edge].mean(axis=0)
        displacement = (float(dx), float(dy))
        scale = max(width, height) / 256.0
        if max(abs(dx), abs(dy)) < STILL_PIXELS * scale:
            motion = "still"
        elif abs(dx) >= abs(dy):
            motion = "right" if dx > 0 else "left"
        else:
            motion = "down" if dy > 0 else "up"
    diffs = np.abs(np.diff(frames.astype(np.float32), axis=0)).mean(axis=(1, 2, 3))
    across = np.array([(i + 1) % chunk_frames == 0 for i in range(count - 1)], dtype=bool)
    return ClipAnalysis(
        background=_nearest(background, _BACKGROUND_TABLE, BACKGROUND_NAMES),
        colour=colour,
        motion=motion,
        shape=shape,
        displacement=displacement,
        fill=fill,
        boundary_diff=float(diffs[across].mean()) if across.any() else float("nan"),
        inside_diff=float(diffs[~across].mean()) if (~across).any() else float("nan"),
        boundary_count=int(across.sum()),
        inside_count=int((~across).sum()),
    )


def chunk_colours(frames: np.ndarray, chunk_frames: int = CHUNK_FRAMES) -> list[str | None]:
    """The object colour of each chunk of a clip (for the interaction check)."""
    background = background_colour(frames)
    colours: list[str | None] = []
    for start in range(0, len(frames), chunk_frames):
        pixels = [
            frame[mask]
            for frame in frames[start : start + chunk_frames]
            if (mask := object_mask(frame, background)).sum() >= 4
        ]
        if not pixels:
            colours.append(None)
            continue
        median = np.median(np.concatenate(pixels).astype(np.float32), axis=0)
        colours.append(_nearest(median, _COLOUR_TABLE, COLOUR_NAMES))
    return colours


# ------------------------------------------------------------------ how it looks

NOISE_MARGIN = 1 / 16
"""How far from the object (a share of the frame's larger side: 16 pixels at 256x256, two
native pixels) a background pixel must be to count for `background_noise`."""


@attrs.frozen(kw_only=True)
class Look:
    """How one clip's frames look: per frame whether the object is split across two
    opposite edges (``split``) or touches one (``cut``); every edge width found; each
    frame's background noise (the largest of its three channels' standard deviations)."""

    split: np.ndarray
    cut: np.ndarray
    edge_widths: np.ndarray
    noise: np.ndarray


def look(frames: np.ndarray) -> Look:
    """How a clip of (T, H, W, 3) uint8 frames looks (see the module's docstring)."""
    background = background_colour(frames)
    split, cut, widths, noise = [], [], [], []
    for frame in frames:
        mask = object_mask(frame, background)
        found = mask.sum() >= 4
        across = (mask[:, 0].any() and mask[:, -1].any()) or (mask[0].any() and mask[-1].any())
        touches = mask[:, 0].any() or mask[:, -1].any() or mask[0].any() or mask[-1].any()
        split.append(bool(found and across))
        cut.append(bool(found and touches))
        if found:
            widths.extend(edge_widths(frame, mask, background))
        noise.append(background_noise(frame, mask))
    return Look(
        split=np.array(split),
        cut=np.array(cut),
        edge_widths=np.array(widths),
        noise=np.array(noise),
    )


def edge_widths(frame: np.ndarray, mask: np.ndarray, background: np.ndarray) -> list[float]:
    """The 90% to 10% widths of the object's edges (pixels) along the row and the column
    through its centre, going out from the centre each way (round the frame, as the world
    wraps); none where the centre is not well inside the object."""
    height, width = mask.shape
    ys, xs = np.nonzero(mask)
    cx, cy = _circular_mean(xs + 0.5, width), _circular_mean(ys + 0.5, height)
    colour = np.median(frame[mask].astype(np.float32), axis=0)
    direction = colour - background
    contrast = ((frame.astype(np.float32) - background) @ direction) / float(direction @ direction)
    row, column = int(cy) % height, int(cx) % width
    widths = []
    for line, start in ((contrast[row], column), (contrast[:, column], row)):
        if line[start] < 0.9:
            continue
        for way in (1, -1):
            found = _edge_width(line, start, way)
            if found is not None:
                widths.append(found)
    return widths


def _edge_width(line: np.ndarray, start: int, way: int) -> float | None:
    """From ``start`` (inside) along ``line`` (wrapping) the ``way`` given: the distance
    from the last crossing of 0.9 to the first of 0.1 after it, linearly between pixels."""
    count = len(line)
    high: float | None = None
    for step in range(1, count):
        before = float(line[(start + (step - 1) * way) % count])
        value = float(line[(start + step * way) % count])
        if before >= 0.9 > value:
            high = step - 1 + (before - 0.9) / (before - value)
        if high is not None and before > 0.1 >= value:
            return step - 1 + (before - 0.1) / (before - value) - high
    return None


def background_noise(frame: np.ndarray, mask: np.ndarray) -> float:
    """The largest of the three channels' spatial standard deviations (levels) over the
    pixels at least `NOISE_MARGIN` of the frame from the object; NaN if there are none."""
    height, width = mask.shape
    margin = max(1, round(NOISE_MARGIN * max(height, width)))
    near = _dilate(_dilate(mask, margin, axis=0), margin, axis=1)
    pixels = frame[~near].astype(np.float64)
    if len(pixels) < 2:
        return float("nan")
    return float(pixels.std(axis=0).max())


def _dilate(mask: np.ndarray, margin: int, axis: int) -> np.ndarray:
    """``mask`` grown by ``margin`` pixels each way along ``axis`` (not wrapping)."""
    counts = np.cumsum(mask, axis=axis, dtype=np.int64)
    padded = np.concatenate([np.zeros_like(counts.take([0], axis=axis)), counts], axis=axis)
    size = mask.shape[axis]
    top = np.minimum(np.arange(size) + margin + 1, size)
    bottom = np.maximum(np.arange(size) - margin, 0)
    return (padded.take(top, axis=axis) - padded.take(bottom, axis=axis)) > 0


# ------------------------------------------------------------------ prompt sets

_TEMPLATES = {
    "tune": (
        "a {size}{colour} {shape} {motion} on a {background} background",
        "{size}{colour} {shape}, {motion}, {background} background",
    ),
    "eval": (
        "A {size}{colour} {shape} that is {motion}, against a {background} backdrop.",
        "{background} background with a {size}{colour} {shape} {motion}",
        "one {size}{colour} {shape} {motion} over {background}",
    ),
}
_SHAPE_WORDS: dict[str, dict[str, tuple[str, ...]]] = {
    "tune": {"circle": ("circle",), "square": ("square",), "triangle": ("triangle",)},
    "eval": {
        "circle": ("circle", "ball", "disc"),
        "square": ("square", "box", "block"),
        "triangle": ("triangle", "wedge"),
    },
}
_MOTION_WORDS: dict[str, dict[str, tuple[str, ...]]] = {
    "tune": {
        "left": ("moving left",),
        "right": ("moving right",),
        "up": ("moving up",),
        "down": ("moving down",),
        "still": ("staying still",),
    },
    "eval": {
        "left": ("moving left", "sliding to the left", "heading west"),
        "right": ("moving right", "drifting rightwards"),
        "up": ("moving up", "rising"),
        "down": ("moving down", "falling"),
        "still": ("standing still", "stationary", "not moving"),
    },
}
_BACKGROUND_WORDS = {
    "black": ("black",),
    "gray": ("gray", "grey"),
    "white": ("white",),
    "navy": ("navy", "navy blue"),
    "dark green": ("dark green",),
}
_SPLIT_SEEDS = {"tune": 1000, "eval": 2000}
SPLITS = tuple(_SPLIT_SEEDS)
"""The prompt sets: ``tune`` (what the model and its defaults were tuned on), ``eval``."""


@attrs.frozen
class EvalCase:
    prompt: str
    seed: int
    slots: Slots


def prompt_set(split: str, count: int) -> list[EvalCase]:
    """``count`` prompts covering the vocabulary evenly, for ``tune`` or ``eval``."""
    if split not in _SPLIT_SEEDS:
        raise ValueError(f"split must be one of {', '.join(_SPLIT_SEEDS)}, got {split!r}")
    rng = random.Random(_SPLIT_SEEDS[split])
    cases = []
    for i in range(count):
        colour = COLOUR_NAMES[i % len(COLOUR_NAMES)]
        motion = MOTIONS[(i // len(COLOUR_NAMES)) % len(MOTIONS)]
        shape = SHAPES[i % len(SHAPES)]
        backgrounds = [b for b in BACKGROUND_NAMES if b != colour]
        background = backgrounds[rng.randrange(len(backgrounds))]
        size = rng.choice(("", "small ", "large "))
        text = rng.choice(_TEMPLATES[split]).format(
            size=size,
            colour=colour,
            shape=rng.choice(_SHAPE_WORDS[split][shape]),
            motion=rng.choice(_MOTION_WORDS[split][motion]),
            background=rng.choice(_BACKGROUND_WORDS[background]),
        )
        truth = Slots(colour=colour, shape=shape, motion=motion, background=background)
        parsed = parse_prompt(text).slots
        assert (parsed.colour, parsed.shape, parsed.motion, parsed.background) == (
            colour,
            shape,
            motion,
            background,
        ), (text, parsed)
        cases.append(EvalCase(prompt=text, seed=_SPLIT_SEEDS[split] + i, slots=truth))
    return cases


# ------------------------------------------------------------------ scoring

BARS = {
    "background": 0.95,
    "colour": 0.90,
    "motion": 0.85,
    # Issue 35's bar (80% before it): what a person calls a triangle is one.
    "shape": 0.95,
    "continuity_ratio": 1.5,
    "interaction": 0.90,
}


def score(cases: Sequence[EvalCase], analyses: Sequence[ClipAnalysis]) -> dict[str, object]:
    """Accuracy per attribute, continuity ratio, and per-value breakdowns."""
    n = len(cases)

    def accuracy(attribute: str) -> float:
        return (
            sum(
                getattr(a, attribute) == getattr(c.slots, attribute)
                for c, a in zip(cases, analyses, strict=True)
            )
            / n
        )

    per_clip_ok = [
        a.boundary_diff <= BARS["continuity_ratio"] * a.inside_diff
        for a in analyses
        if a.boundary_count and a.inside_count
    ]
    breakdown: dict[str, dict[str, float]] = {}
    for attribute, values in (
        ("colour", COLOUR_NAMES),
        ("shape", SHAPES),
        ("motion", MOTIONS),
        ("background", BACKGROUND_NAMES),
    ):
        breakdown[attribute] = {}
        for value in values:
            pairs = [
                (c, a)
                for c, a in zip(cases, analyses, strict=True)
                if getattr(c.slots, attribute) == value
            ]
            if pairs:
                hits = sum(getattr(a, attribute) == value for _, a in pairs)
                breakdown[attribute][value] = round(hits / len(pairs), 3)
    return {
        "clips": n,
        "background": round(accuracy("background"), 4),
        "colour": round(accuracy("colour"), 4),
        "motion": round(accuracy("motion"), 4),
        "shape": round(accuracy("shape"), 4),
        "continuity_ratio": _continuity(analyses),
        "continuity_clips_ok": round(sum(per_clip_ok) / max(1, len(per_clip_ok)), 4),
        "continuity_by_motion": {
            motion: _continuity(
                [a for c, a in zip(cases, analyses, strict=True) if c.slots.motion == motion]
            )
            for motion in MOTIONS
        },
        "median_fill": {s: _median_fill(cases, analyses, s) for s in SHAPES},
        "breakdown": breakdown,
    }


def _continuity(analyses: Sequence[ClipAnalysis]) -> float | None:
    """Pooled boundary difference over pooled inside difference."""
    boundary = sum(a.boundary_diff * a.boundary_count for a in analyses if a.boundary_count)
    inside = sum(a.inside_diff * a.inside_count for a in analyses if a.inside_count)
    n_boundary = sum(a.boundary_count for a in analyses)
    n_inside = sum(a.inside_count for a in analyses)
    if not n_boundary or not n_inside or not inside:
        return None
    return round((boundary / n_boundary) / (inside / n_inside), 4)


def _median_fill(
    cases: Sequence[EvalCase], analyses: Sequence[ClipAnalysis], shape: str
) -> float | None:
    fills = [
        a.fill
        for c, a in zip(cases, analyses, strict=True)
        if c.slots.shape == shape and not np.isnan(a.fill)
    ]
    return round(float(np.median(fills)), 3) if fills else None


def interaction_passed(
    colours: Sequence[str | None], start_index: int, chunks: int, new: str
) -> bool:
    """Is every chunk from boundary ``chunks`` + 1 after the event on in the new colour?"""
    tail = colours[start_index + chunks :]
    return bool(tail) and all(c == new for c in tail)


def table(metrics: dict[str, object]) -> str:
    """The quality table, bars next to the measurements."""
    rows = ["| measure | result | bar | met |", "|---|---|---|---|"]
    for name, bar in BARS.items():
        value = metrics.get(name)
        if value is None:
            continue
        assert isinstance(value, float | int)
        if name == "continuity_ratio":
            rows.append(f"| {name} | {value:.2f} | <= {bar} | {'yes' if value <= bar else 'NO'} |")
        else:
            rows.append(
                f"| {name} | {value:.1%} | >= {bar:.0%} | {'yes' if value >= bar else 'NO'} |"
            )
    return "\n".join(rows)


def failures(cases: Iterable[EvalCase], analyses: Iterable[ClipAnalysis]) -> list[str]:
    """One line per clip that got an attribute wrong: the prompt, the seed, what was seen."""
    lines = []
    for case, a in zip(cases, analyses, strict=True):
        wrong = [
            f"{name}={getattr(a, name)}"
            for name in ("colour", "shape", "motion", "background")
            if getattr(a, name) != getattr(case.slots, name)
        ]
        if wrong:
            lines.append(f"{case.prompt!r} seed {case.seed}: {', '.join(wrong)} fill={a.fill:.2f}")
    return lines

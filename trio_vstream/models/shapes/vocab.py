"""The shapes world's vocabulary and its prompt parser.

A prompt describes one object on a plain background with five attributes
("slots"): object colour, shape, motion, background colour and size. The
parser is deterministic and forgiving: case, punctuation and filler words do
not matter, common synonyms are understood ("ball", "box", "grey"), and words
it does not know are returned so the engine can log them (once) and go on.
Slots a prompt leaves out stay ``None``; :func:`fill_slots` draws them from a
seed, so the same request always gets the same video.

Roles of colour words: a colour word next to "background"/"backdrop" or after
"on"/"against"/"over" names the background; any other colour word names the
object. A colour that is not in its role's palette is mapped to the nearest
one there when there is an obvious one ("navy circle" -> blue, "blue
background" -> navy, "green background" -> dark green) and otherwise left to
the seed ("red background"); either way the parser says so in ``notes``.
"""

from __future__ import annotations

import random
import re

import attrs

OBJECT_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 30, 30),
    "green": (30, 200, 50),
    "blue": (40, 90, 255),
    "yellow": (250, 230, 30),
    "purple": (150, 50, 210),
    "orange": (255, 130, 0),
    "white": (240, 240, 240),
    "cyan": (30, 220, 230),
}
"""Object colours (RGB 0-255), in slot-index order."""

BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
    "white": (240, 240, 240),
    "navy": (20, 30, 100),
    "dark green": (20, 80, 35),
}
"""Background colours (RGB 0-255), in slot-index order."""

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
MOTIONS: tuple[str, ...] = ("left", "right", "up", "down", "still")
SIZES: tuple[str, ...] = ("small", "large")

MOTION_VECTORS: dict[str, tuple[int, int]] = {
    "left": (-1, 0),
    "right": (1, 0),
    "up": (0, -1),
    "down": (0, 1),
    "still": (0, 0),
}
"""Per-frame displacement in native pixels (x right, y down); the world wraps."""

COLOUR_NAMES = tuple(OBJECT_COLOURS)
BACKGROUND_NAMES = tuple(BACKGROUNDS)
SLOT_NAMES = ("colour", "shape", "motion", "background", "size")
SLOT_SIZES = {
    "colour": len(COLOUR_NAMES),
    "shape": len(SHAPES),
    "motion": len(MOTIONS),
    "background": len(BACKGROUND_NAMES),
    "size": len(SIZES),
}

# Multi-word terms are joined with "_" before lookup; longest first.
_PHRASES: tuple[tuple[str, str], ...] = (
    ("not moving", "still"),
    ("standing still", "still"),
    ("staying put", "still"),
    ("in place", "still"),
    ("to the left", "left"),
    ("to the right", "right"),
    ("dark green", "dark_green"),
    ("forest green", "dark_green"),
    ("navy blue", "navy"),
    ("dark blue", "navy"),
    ("midnight blue", "navy"),
    ("light blue", "cyan"),
    ("sky blue", "cyan"),
    ("light gray", "gray"),
    ("light grey", "gray"),
    ("dark gray", "gray"),
    ("dark grey", "gray"),
)

_COLOUR_WORDS: dict[str, str] = {
    "red": "red",
    "crimson": "red",
    "scarlet": "red",
    "green": "green",
    "lime": "green",
    "blue": "blue",
    "azure": "blue",
    "yellow": "yellow",
    "gold": "yellow",
    "golden": "yellow",
    "purple": "purple",
    "violet": "purple",
    "magenta": "purple",
    "lilac": "purple",
    "orange": "orange",
    "amber": "orange",
    "white": "white",
    "cyan": "cyan",
    "aqua": "cyan",
    "turquoise": "cyan",
    "teal": "cyan",
    "black": "black",
    "dark": "black",
    "gray": "gray",
    "grey": "gray",
    "silver": "gray",
    "navy": "navy",
    "dark_green": "dark green",
}
_SHAPE_WORDS: dict[str, str] = {
    "circle": "circle",
    "circles": "circle",
    "ball": "circle",
    "disc": "circle",
    "disk": "circle",
    "dot": "circle",
    "sphere": "circle",
    "orb": "circle",
    "round": "circle",
    "square": "square",
    "squares": "square",
    "box": "square",
    "block": "square",
    "cube": "square",
    "tile": "square",
    "rectangle": "square",
    "triangle": "triangle",
    "triangles": "triangle",
    "pyramid": "triangle",
    "wedge": "triangle",
    "triangular": "triangle",
}
_MOTION_WORDS: dict[str, str] = {
    "left": "left",
    "leftward": "left",
    "leftwards": "left",
    "west": "left",
    "westward": "left",
    "right": "right",
    "rightward": "right",
    "rightwards": "right",
    "east": "right",
    "eastward": "right",
    "up": "up",
    "upward": "up",
    "upwards": "up",
    "rising": "up",
    "rises": "up",
    "ascending": "up",
    "climbing": "up",
    "north": "up",
    "down": "down",
    "downward": "down",
    "downwards": "down",
    "falling": "down",
    "falls": "down",
    "descending": "down",
    "dropping": "down",
    "sinking": "down",
    "south": "down",
    "still": "still",
    "stationary": "still",
    "static": "still",
    "motionless": "still",
    "resting": "still",
    "fixed": "still",
    "frozen": "still",
    "idle": "still",
    "steady": "still",
}
_SIZE_WORDS: dict[str, str] = {
    "small": "small",
    "tiny": "small",
    "little": "small",
    "mini": "small",
    "large": "large",
    "big": "large",
    "huge": "large",
    "giant": "large",
    "bigger": "large",
}
_CROSS_ROLE: dict[str, str] = {
    "blue": "navy",
    "cyan": "navy",
    "green": "dark green",
    "navy": "blue",
    "dark green": "green",
}
"""A colour named in the other role's palette, mapped to this role's closest one."""
_BACKGROUND_MARKERS = frozenset({"background", "backdrop", "bg", "backgrounds"})
_BACKGROUND_PREPOSITIONS = frozenset({"on", "against", "over", "onto", "upon"})
_FILLER = frozenset(
    {
        "a",
        "an",
        "the",
        "of",
        "in",
        "with",
        "and",
        "is",
        "its",
        "it",
        "that",
        "which",
        "while",
        "one",
        "single",
        "moving",
        "moves",
        "move",
        "going",
        "goes",
        "heading",
        "drifting",
        "drifts",
        "sliding",
        "slides",
        "travelling",
        "traveling",
        "floating",
        "gliding",
        "scrolling",
        "staying",
        "stays",
        "sitting",
        "sits",
        "standing",
        "to",
        "toward",
        "towards",
        "from",
        "across",
        "screen",
        "plain",
        "solid",
        "colour",
        "color",
        "coloured",
        "colored",
        "sized",
        "shape",
        "shaped",
        "object",
        "video",
        "slowly",
        "quickly",
        "steadily",
        "side",
        "direction",
        "very",
        "bright",
        "light",
        "filled",
        "flat",
        "simple",
    }
    | _BACKGROUND_MARKERS
    | _BACKGROUND_PREPOSITIONS
)


@attrs.frozen
class Slots:
    """One value per attribute; ``None`` where the prompt did not say."""

    colour: str | None = None
    shape: str | None = None
    motion: str | None = None
    background: str | None = None
    size: str | None = None

    def indices(self) -> tuple[int | None, ...]:
        """Slot indices in ``SLOT_NAMES`` order (``None`` stays ``None``)."""
        return (
            None if self.colour is None else COLOUR_NAMES.index(self.colour),
            None if self.shape is None else SHAPES.index(self.shape),
            None if self.motion is None else MOTIONS.index(self.motion),
            None if self.background is None else BACKGROUND_NAMES.index(self.background),
            None if self.size is None else SIZES.index(self.size),
        )

    def describe(self) -> str:
        """The canonical prompt for these slots (for logs and evaluation)."""
        words = [w for w in (self.size, self.colour, self.shape) if w]
        text = "a " + " ".join(words or ["object"])
        if self.motion:
            text += " staying still" if self.motion == "still" else f" moving {self.motion}"
        if self.background:
            text += f" on a {self.background} background"
        return text


@attrs.frozen
class ParsedPrompt:
    slots: Slots
    unknown_words: tuple[str, ...] = ()
    """Words the parser did not understand, in order of appearance, once each."""
    notes: tuple[str, ...] = ()
    """Forgiving decisions worth a log line (a colour moved to the other palette)."""


def _tokens(prompt: str) -> list[str]:
    text = " " + re.sub(r"[^a-z0-9]+", " ", prompt.lower()) + " "
    for phrase, joined in _PHRASES:
        text = text.replace(f" {phrase} ", f" {joined} ")
    return text.split()


def parse_prompt(prompt: str) -> ParsedPrompt:
    """Read the slots out of a prompt. Deterministic; never raises.

    When a slot is named twice, the first mention wins (later ones are noted).
    """
    tokens = _tokens(prompt)
    values: dict[str, str] = {}
    unknown: list[str] = []
    notes: list[str] = []

    def put(slot: str, value: str) -> None:
        if slot not in values:
            values[slot] = value
        elif values[slot] != value:
            notes.append(f"{slot} {value!r} ignored: already {values[slot]!r}")

    for i, token in enumerate(tokens):
        if token in _COLOUR_WORDS:
            colour = _COLOUR_WORDS[token]
            before = tokens[max(0, i - 2) : i]
            after = tokens[i + 1 : i + 3]
            is_background = bool(_BACKGROUND_MARKERS.intersection(after[:2])) or bool(
                _BACKGROUND_PREPOSITIONS.intersection(before)
            )
            if token == "dark" and not is_background:
                continue  # "dark" alone is only a background word ("on a dark background")
            palette = BACKGROUNDS if is_background else OBJECT_COLOURS
            slot = "background" if is_background else "colour"
            if colour not in palette:
                mapped = _CROSS_ROLE.get(colour)
                if mapped is None:
                    role = "a background" if is_background else "an object"
                    notes.append(f"{colour!r} is not {role} colour: {slot} left to the seed")
                    continue
                notes.append(f"{slot} {colour!r} is not in the palette: using {mapped!r}")
                colour = mapped
            put(slot, colour)
        elif token in _SHAPE_WORDS:
            put("shape", _SHAPE_WORDS[token])
        elif token in _MOTION_WORDS:
            put("motion", _MOTION_WORDS[token])
        elif token in _SIZE_WORDS:
            put("size", _SIZE_WORDS[token])
        elif token in _FILLER or token.isdigit():
            continue
        elif token not in unknown:
            unknown.append(token)
    slots = Slots(**values)
    if slots.colour is not None and slots.colour == slots.background:
        notes.append(f"background {slots.background!r} is the object's colour: left to the seed")
        slots = attrs.evolve(slots, background=None)
    return ParsedPrompt(slots=slots, unknown_words=tuple(unknown), notes=tuple(notes))


@attrs.frozen
class SeedDefaults:
    """What a stream uses for every slot a prompt leaves out, drawn once from its seed.

    Drawn once per stream (not per prompt) so that an interaction that only
    names a new colour keeps the motion, background and size the video had.
    """

    colour: str
    shape: str
    motion: str
    background: str
    spare_background: str
    """Used when ``background`` would be the object's colour."""
    size: str

    @classmethod
    def from_seed(cls, seed: int) -> SeedDefaults:
        rng = random.Random(f"shapes-slots-{seed}")
        background = rng.choice(BACKGROUND_NAMES)
        spare = rng.choice([b for b in BACKGROUND_NAMES if b not in OBJECT_COLOURS])
        return cls(
            colour=rng.choice(COLOUR_NAMES),
            shape=rng.choice(SHAPES),
            motion=rng.choice(MOTIONS),
            background=background,
            spare_background=spare,
            size=rng.choice(SIZES),
        )


def fill_slots(slots: Slots, defaults: SeedDefaults) -> Slots:
    """Complete a prompt's slots with the stream's seed defaults.

    The background is never the object's colour: a default that collides is
    replaced by the stream's spare background (never an object colour).
    """
    colour = slots.colour or defaults.colour
    background = slots.background or defaults.background
    if background == colour:
        background = defaults.spare_background
    return Slots(
        colour=colour,
        shape=slots.shape or defaults.shape,
        motion=slots.motion or defaults.motion,
        background=background,
        size=slots.size or defaults.size,
    )


def vocabulary_table() -> str:
    """The vocabulary as Markdown, for docs/shapes.md (kept next to the parser it documents)."""

    def synonyms(words: dict[str, str], value: str) -> str:
        forms = {w.replace("_", " ") for w, v in words.items() if v == value}
        forms |= {phrase for phrase, joined in _PHRASES if words.get(joined) == value}
        return ", ".join(sorted(forms))

    rows = ["| slot | values (synonyms) |", "|---|---|"]
    rows.append(
        "| colour | "
        + "; ".join(f"{c} ({synonyms(_COLOUR_WORDS, c)})" for c in COLOUR_NAMES)
        + " |"
    )
    rows.append(
        "| shape | " + "; ".join(f"{s} ({synonyms(_SHAPE_WORDS, s)})" for s in SHAPES) + " |"
    )
    rows.append(
        "| motion | " + "; ".join(f"{m} ({synonyms(_MOTION_WORDS, m)})" for m in MOTIONS) + " |"
    )
    rows.append(
        "| background | "
        + "; ".join(f"{b} ({synonyms(_COLOUR_WORDS, b)})" for b in BACKGROUND_NAMES)
        + " |"
    )
    rows.append("| size | " + "; ".join(f"{s} ({synonyms(_SIZE_WORDS, s)})" for s in SIZES) + " |")
    return "\n".join(rows)

"""The shapes denoiser: a small conditional conv UNet over a whole chunk at once.

Why this shape of network:

* A chunk of ``chunk_frames`` native frames is denoised jointly, frames
  stacked as channels, so motion inside a chunk is one coherent prediction
  (no per-frame flicker) and a step costs one 2D UNet pass. The input is
  pixel-unshuffled 2x2 (and the output shuffled back), so the UNet runs at
  16x16/8x8/4x4: a quarter of the compute, which is what makes training in
  under an hour on two CPU cores possible.
* The last frame of the previous chunk (or the reference image, or nothing)
  is concatenated as extra input channels with a mask channel saying whether
  it is there, and (``context_skip``) added to every frame of the output, so
  the network predicts what changes from the context rather than the whole
  picture. That is what makes consecutive chunks join without a jump: a
  network that redraws the background of every chunk leaves a faint
  pattern of its own in it, different from chunk to chunk; one that copies
  it carries the previous chunk's pattern on unchanged.
  When there is nothing (chunk 0 of a text-to-video request), one more
  channel holds a blob where the object starts: the start position is drawn
  from the seed like any slot the prompt leaves out. Without it, chunk 0
  would have to pick a position out of pure noise, which a few-step sampler
  of a small, briefly trained model does badly (faint, smeared objects).
* All convolutions pad circularly: the world is a torus, so the network is
  exactly translation-equivariant with wrap-around, and it does not have to
  learn the edges.
* Conditioning is a slot encoder (one learned embedding per attribute value,
  plus a "null" entry per slot for classifier-free guidance) followed by an
  MLP; its output vector is the prompt embedding, which the engine blends
  across prompt transitions. It reaches every residual block through FiLM,
  together with the flow-matching time.

The network is trained by rectified flow matching on the path
``x_t = (1 - t) x0 + t noise`` (images in [-1, 1]) and parametrised to
predict the clean chunk ``x0`` (the velocity is ``(x_t - x0) / t``). Predicting
``x0`` rather than ``v`` spares the network from learning to pass the noise
through, which a v-predicting model of this size had not learned after the
first few hundred steps of a CPU run; it also makes every step's output a
picture, which is what the few-step sampler returns at the end.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import attrs
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

from trio_vstream.models.shapes.vocab import SLOT_NAMES, SLOT_SIZES


@attrs.frozen(kw_only=True)
class ModelConfig:
    """Architecture settings; stored in the weights file so a checkpoint describes itself."""

    native_size: int = 32
    chunk_frames: int = 8
    channels: tuple[int, ...] = (64, 128, 192)
    blocks: int = 1
    patch: int = 2
    """Pixel-unshuffle factor at the input (and shuffle at the output): 2 runs the
    UNet at half resolution with 4x the channels, a quarter of the compute."""
    slot_dim: int = 64
    embed_dim: int = 256
    context_skip: bool = False
    """Predict each frame as the context frame plus a change (when there is a
    context): unchanged background is then copied, not redrawn, so chunks
    join without a jump. False reads checkpoints written before the option."""

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("model config is not a JSON object")
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown model config keys: {', '.join(unknown)}")
        if "channels" in data:
            data["channels"] = tuple(int(c) for c in data["channels"])
        return cls(**data)


def _conv(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, padding_mode="circular")


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(8, channels)


class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv twice, FiLM from the embedding in between, residual."""

    def __init__(self, cin: int, cout: int, embed_dim: int) -> None:
        super().__init__()
        self.norm1 = _norm(cin)
        self.conv1 = _conv(cin, cout)
        self.film = nn.Linear(embed_dim, 2 * cout)
        self.norm2 = _norm(cout)
        self.conv2 = _conv(cout, cout)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()
        nn.init.zeros_(self.conv2.weight)
        assert self.conv2.bias is not None  # _conv's convolutions have a bias
        nn.init.zeros_(self.conv2.bias)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.film(emb)[:, :, None, None].chunk(2, dim=1)
        h = F.silu(self.norm2(h) * (1 + scale) + shift)
        return self.skip(x) + self.conv2(h)


class SlotEncoder(nn.Module):
    """The text encoder: slot distributions -> prompt embedding.

    Each slot arrives as a probability vector over its values plus a final
    "null" entry (one-hot for a parsed prompt; all mass on null when the slot
    is dropped or unspecified), so the unconditional branch, a negative
    prompt and a plain prompt all go through the same encoder.
    """

    def __init__(self, slot_dim: int, embed_dim: int) -> None:
        super().__init__()
        self.tables = nn.ParameterDict(
            {
                name: nn.Parameter(torch.randn(SLOT_SIZES[name] + 1, slot_dim) * 0.5)
                for name in SLOT_NAMES
            }
        )
        self.mlp = nn.Sequential(
            nn.Linear(slot_dim * len(SLOT_NAMES), embed_dim),
            nn.SiLU(),
            nn.Linear(embed_dim, embed_dim),
        )

    def forward(self, slots: Mapping[str, torch.Tensor]) -> torch.Tensor:
        parts = [slots[name] @ self.tables[name] for name in SLOT_NAMES]
        return self.mlp(torch.cat(parts, dim=-1))


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(
        -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    )
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ShapesDenoiser(nn.Module):
    """UNet: (noisy chunk, time, context frame, prompt embedding) -> clean chunk."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        c = config.channels
        e = config.embed_dim
        frames = 3 * config.chunk_frames
        self.encoder = SlotEncoder(config.slot_dim, e)
        self.time_mlp = nn.Sequential(nn.Linear(128, e), nn.SiLU(), nn.Linear(e, e))
        patch_area = config.patch * config.patch
        # Inputs: noisy chunk, context frame, context mask, start-position hint.
        self.stem = _conv((frames + 5) * patch_area, c[0])
        self.down_blocks = nn.ModuleList()
        self.downsamples = nn.ModuleList()
        skips = [c[0]]
        cin = c[0]
        for level, width in enumerate(c):
            blocks = nn.ModuleList()
            for _ in range(config.blocks):
                blocks.append(ResBlock(cin, width, e))
                cin = width
                skips.append(width)
            self.down_blocks.append(blocks)
            if level < len(c) - 1:
                self.downsamples.append(_conv(cin, cin, stride=2))
                skips.append(cin)
        self.mid = nn.ModuleList([ResBlock(cin, cin, e), ResBlock(cin, cin, e)])
        self.up_blocks = nn.ModuleList()
        for level, width in reversed(list(enumerate(c))):
            blocks = nn.ModuleList()
            for _ in range(config.blocks + 1):
                blocks.append(ResBlock(cin + skips.pop(), width, e))
                cin = width
            self.up_blocks.append(blocks)
            del level
        self.out_norm = _norm(cin)
        self.out = _conv(cin, frames * patch_area)
        nn.init.zeros_(self.out.weight)
        assert self.out.bias is not None  # _conv's convolutions have a bias
        nn.init.zeros_(self.out.bias)

    def embed(self, slots: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The prompt embedding (what transitions blend)."""
        return self.encoder(slots)

    def forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        context: torch.Tensor,
        context_mask: torch.Tensor,
        cond: torch.Tensor,
        hint: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` (B, 3T, S, S), ``t`` (B,), ``context`` (B, 3, S, S) in [-1, 1],
        ``context_mask`` (B,) 1 where there is a context, ``cond`` (B, E), ``hint``
        (B, 1, S, S) a blob where the object should start when there is no context."""
        emb = F.silu(self.time_mlp(timestep_embedding(t, 128)) + cond)
        mask = context_mask.view(-1, 1, 1, 1).to(x.dtype)
        context = context * mask
        if hint is None:
            hint = torch.zeros_like(x[:, :1])
        h = torch.cat([x, context, mask.expand(-1, 1, *x.shape[2:]), hint], 1)
        patch = self.config.patch
        h = self.stem(F.pixel_unshuffle(h, patch) if patch > 1 else h)
        skips = [h]
        for level, blocks in enumerate(self.down_blocks):
            for block in cast(nn.ModuleList, blocks):
                h = block(h, emb)
                skips.append(h)
            if level < len(self.downsamples):
                h = self.downsamples[level](h)
                skips.append(h)
        for block in self.mid:
            h = block(h, emb)
        for level, blocks in enumerate(self.up_blocks):
            for block in cast(nn.ModuleList, blocks):
                h = block(torch.cat([h, skips.pop()], 1), emb)
            if level < len(self.up_blocks) - 1:
                h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        out = self.out(F.silu(self.out_norm(h)))
        out = F.pixel_shuffle(out, patch) if patch > 1 else out
        if self.config.context_skip:
            out = out + context.repeat(1, self.config.chunk_frames, 1, 1)
        return out


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------ weights

CONFIG_KEY = "shapes_model_config"
FORMAT_KEY = "format"
FORMAT_VALUE = "trio_vstream.shapes/1"


class WeightsError(Exception):
    """A weights file that is missing, unreadable, or does not fit the model."""


def save_weights(model: ShapesDenoiser, path: Path, *, dtype: torch.dtype = torch.float16) -> None:
    """Write a self-describing safetensors file (config in the metadata)."""
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(
        state,
        str(path),
        metadata={FORMAT_KEY: FORMAT_VALUE, CONFIG_KEY: model.config.to_json()},
    )


def load_weights(path: Path, device: torch.device | str = "cpu") -> ShapesDenoiser:
    """Build the model a weights file describes and load it, checking every tensor.

    Raises :class:`WeightsError` naming the file and the first problems found:
    a missing file, a file that is not safetensors, a file from another model,
    missing or unexpected tensors, or shapes that do not match.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"weights file not found: {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise WeightsError(f"cannot read weights file {path}: {exc}") from None
    if metadata.get(FORMAT_KEY) != FORMAT_VALUE or CONFIG_KEY not in metadata:
        raise WeightsError(
            f"{path} is not a shapes model checkpoint (metadata {FORMAT_KEY}="
            f"{metadata.get(FORMAT_KEY)!r}, expected {FORMAT_VALUE!r})"
        )
    try:
        config = ModelConfig.from_json(metadata[CONFIG_KEY])
        model = ShapesDenoiser(config)
    except (ValueError, TypeError) as exc:
        raise WeightsError(f"{path} has an invalid model config: {exc}") from None
    expected = model.state_dict()
    problems: list[str] = []
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"{len(missing)} missing tensor(s), e.g. {', '.join(missing[:3])}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s), e.g. {', '.join(unexpected[:3])}")
    mismatched = [
        f"{key} has shape {tuple(tensors[key].shape)}, expected {tuple(expected[key].shape)}"
        for key in sorted(set(expected) & set(tensors))
        if tensors[key].shape != expected[key].shape
    ]
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es): {'; '.join(mismatched[:3])}")
    if problems:
        raise WeightsError(f"weights file {path} does not fit the model: {'; '.join(problems)}")
    model.load_state_dict({k: v.float() for k, v in tensors.items()})
    return model.to(device).eval()


def slot_vectors(indices: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Integer slot values (B,) per slot, -1 for "null", to the encoder's one-hot input."""
    vectors = {}
    for name in SLOT_NAMES:
        index = indices[name].long()
        size = SLOT_SIZES[name]
        index = torch.where(index < 0, torch.full_like(index, size), index)
        vectors[name] = F.one_hot(index, size + 1).float()
    return vectors

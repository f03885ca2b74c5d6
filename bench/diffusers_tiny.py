"""Random Wan pipelines for the bench's ``diffusers`` scenario: the same builders the
diffusers engine's tests use, which live in ``trio_vstream.engines.diffusers.testing``.

This module keeps the names the harness has always taken from here (``WanSize``,
``TINY``, ``build_wan_t2v``, ...). They load on first use, so importing this module stays
free: the engine's package, which holds them, imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trio_vstream.engines.diffusers.testing import (
        TEXT_DIM,
        TINY,
        WanSize,
        build_anyflow_far,
        build_helios,
        build_lora,
        build_skyreels_df,
        build_wan_i2v,
        build_wan_t2v,
        scheduler,
        text_encoder_and_tokenizer,
        transformer,
        vae,
    )

__all__ = [
    "TEXT_DIM",
    "TINY",
    "WanSize",
    "build_anyflow_far",
    "build_helios",
    "build_lora",
    "build_skyreels_df",
    "build_wan_i2v",
    "build_wan_t2v",
    "scheduler",
    "text_encoder_and_tokenizer",
    "transformer",
    "vae",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("trio_vstream.engines.diffusers.testing"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

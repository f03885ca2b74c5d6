"""Deprecated: the tiny random pipelines moved to `trio_vstream.engines.diffusers.testing`.

This module re-exports the same objects from there, and warns (`DeprecationWarning`) when
it is first imported, so code written against the old path keeps working while it moves:
``from trio_vstream.engines.diffusers.testing import build_wan_t2v`` instead of
``... .tiny import build_wan_t2v``. They moved because a module of test builders (close
to a thousand lines, every family's) sat among the engine's run-time modules; the new
package splits them by family. It will be removed in a later release.
"""

from __future__ import annotations

import warnings

from trio_vstream.engines.diffusers.testing import (
    ANYFLOW_FAR_PARTITION,
    FRAMEPACK_WORDS,
    HELIOS_GAMMA,
    HELIOS_VARIANTS,
    LTX2_BENCH,
    LTX2_TINY,
    LTX2_WORDS,
    SANA_WM_GPU,
    SANA_WM_TINY,
    SANA_WM_WORDS,
    SKYREELS_DF_VARIANTS,
    TEXT_DIM,
    TINY,
    LTX2Size,
    SanaWMSize,
    WanSize,
    build_anyflow_far,
    build_framepack,
    build_helios,
    build_lora,
    build_ltx2,
    build_ltx2_i2v,
    build_sana_wm,
    build_skyreels_df,
    build_wan_i2v,
    build_wan_t2v,
    scheduler,
    text_encoder_and_tokenizer,
    transformer,
    vae,
    word_tokenizer,
)

__all__ = [
    "ANYFLOW_FAR_PARTITION",
    "FRAMEPACK_WORDS",
    "HELIOS_GAMMA",
    "HELIOS_VARIANTS",
    "LTX2_BENCH",
    "LTX2_TINY",
    "LTX2_WORDS",
    "SANA_WM_GPU",
    "SANA_WM_TINY",
    "SANA_WM_WORDS",
    "SKYREELS_DF_VARIANTS",
    "TEXT_DIM",
    "TINY",
    "LTX2Size",
    "SanaWMSize",
    "WanSize",
    "build_anyflow_far",
    "build_framepack",
    "build_helios",
    "build_lora",
    "build_ltx2",
    "build_ltx2_i2v",
    "build_sana_wm",
    "build_skyreels_df",
    "build_wan_i2v",
    "build_wan_t2v",
    "scheduler",
    "text_encoder_and_tokenizer",
    "transformer",
    "vae",
    "word_tokenizer",
]

warnings.warn(
    "trio_vstream.engines.diffusers.tiny is deprecated: import the same names from "
    "trio_vstream.engines.diffusers.testing",
    DeprecationWarning,
    stacklevel=2,
)

"""Tiny random pipelines for tests, benchmarks and offline demos, built in code: nothing
is downloaded.

They are not part of the engine at run time (the engine imports nothing of this
package); they are here, in the installed package, so that the benchmark and anyone who
wants to try the server offline can build one: ``build_wan_t2v(path)`` (or
``build_wan_v2v(path)``, a video-to-video one), then ``--engine diffusers --engine-arg
model=path``. The engine's tests and the benchmark's ``diffusers`` scenario both serve
pipelines made here, so the bench measures the engine on the very pipeline the tests
check it on.

One module per family (or group of families sharing their parts): `wan` (Wan, its
video-to-video pipeline, its LoRA, and the Wan parts that `helios`, `skyreels_df` and
`anyflow_far` are built from), `framepack`, `sana_wm` and `ltx2`. Each ``build_*``
function writes a pipeline directory with ``save_pretrained``, exactly what
``--engine-arg model=...`` reads. This package re-exports every public name of its
modules.

The functions need the ``diffusers`` extra (diffusers, transformers; peft for
``build_lora``), which they import when called. Importing this package imports the
engine's package, and with it torch.

They used to live in one module, ``trio_vstream.engines.diffusers.tiny``, which still
imports (re-exporting these) with a `DeprecationWarning`.
"""

from __future__ import annotations

from trio_vstream.engines.diffusers.testing._common import word_tokenizer
from trio_vstream.engines.diffusers.testing.anyflow_far import (
    ANYFLOW_FAR_PARTITION,
    build_anyflow_far,
)
from trio_vstream.engines.diffusers.testing.framepack import FRAMEPACK_WORDS, build_framepack
from trio_vstream.engines.diffusers.testing.helios import (
    HELIOS_GAMMA,
    HELIOS_VARIANTS,
    build_helios,
)
from trio_vstream.engines.diffusers.testing.ltx2 import (
    LTX2_BENCH,
    LTX2_TINY,
    LTX2_WORDS,
    LTX2Size,
    build_ltx2,
    build_ltx2_i2v,
)
from trio_vstream.engines.diffusers.testing.sana_wm import (
    SANA_WM_GPU,
    SANA_WM_TINY,
    SANA_WM_WORDS,
    SanaWMSize,
    build_sana_wm,
)
from trio_vstream.engines.diffusers.testing.skyreels_df import (
    SKYREELS_DF_VARIANTS,
    build_skyreels_df,
)
from trio_vstream.engines.diffusers.testing.wan import (
    TEXT_DIM,
    TINY,
    WanSize,
    build_lora,
    build_wan_i2v,
    build_wan_t2v,
    build_wan_v2v,
    scheduler,
    text_encoder_and_tokenizer,
    transformer,
    vae,
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
    "build_wan_v2v",
    "scheduler",
    "text_encoder_and_tokenizer",
    "transformer",
    "vae",
    "word_tokenizer",
]

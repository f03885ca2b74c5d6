"""The ``shapes`` engine: the built-in video diffusion model, on CPU or CUDA.

A toy-scale model of a simple world (one coloured object moving on a plain
background; see :mod:`trio_vstream.models.shapes`) that is nevertheless a
real chunk-autoregressive video diffusion model: a text (slot) encoder, a
denoiser conditioned on the last frame of the previous chunk, classifier-free
guidance and a few-step flow-matching sampler whose steps are checkpoints.
Its weights ship with the package, so ``python -m trio_vstream --engine
shapes`` works on a fresh machine with no GPU and no network.

Its modules, one idea each:

* ``engine``: `ShapesEngine` (the loaded model, shared, batched), `ShapesStream` (one
  session's video), their settings and `create_engine`, the ``--engine shapes``
  factory;
* ``steering``: how a camera velocity steers the world (`camera_motion`), and how the
  steers of a paced chunk's action window are integrated (`window_shares`,
  `integrated_motion`): the chunk moves the way of their net displacement, so a short
  press counts;
* ``following``: how a stream follows an input video (`interfaces.FollowsInput`): the
  input's dominant coloured region found on a small grid, and each generated frame moved
  toward it round the torus, by a share that ``VideoInput.strength`` sets;
* ``pixels``: the native 32x32 frames read as what the model draws (one object's colour
  and membership over a plain background) and drawn again at the requested size, crisp
  and flat (the square world is stretched to other aspect ratios), in uint8 on the
  model's device, so a CUDA chunk's pixels cross to the host once, in the server's
  delivery thread (`ShapesFrames` defers the drawing there); frames two colours do not
  explain are resized as they are; a reference image as the first context;
* ``view``: where the screen shows the object (`ObjectView`): whole, never split across
  two edges of the torus; moving on its own, it comes in whole at the opposite edge when
  its next step would cut it.

The names are re-exported here: ``trio_vstream.engines.shapes:create_engine`` is the
path `trio_vstream.engines.BUILTIN_ENGINES` names.
"""

from __future__ import annotations

from trio_vstream.engines.shapes.engine import (
    MAX_REPORTED_WORDS,
    START_MARGIN,
    ShapesEngine,
    ShapesSettings,
    ShapesStream,
    create_engine,
    default_weights_path,
    parse_settings,
    start_position,
)
from trio_vstream.engines.shapes.pixels import ShapesFrames, image_to_context, to_uint8_frames
from trio_vstream.engines.shapes.steering import (
    WindowChange,
    camera_motion,
    integrated_motion,
    window_shares,
)

__all__ = [
    "MAX_REPORTED_WORDS",
    "START_MARGIN",
    "ShapesEngine",
    "ShapesFrames",
    "ShapesSettings",
    "ShapesStream",
    "WindowChange",
    "camera_motion",
    "create_engine",
    "default_weights_path",
    "image_to_context",
    "integrated_motion",
    "parse_settings",
    "start_position",
    "to_uint8_frames",
    "window_shares",
]

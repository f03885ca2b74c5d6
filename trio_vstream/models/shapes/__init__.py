"""A small chunk-autoregressive video diffusion model of a simple world.

One object (8 colours, 3 shapes, 2 sizes) moves left, right, up, down or
stays still on a plain background (5 colours), in a 32x32 world that wraps
at the edges. Its modules and files (vocabulary, renderer, denoiser, sampler,
training, evaluation, the shipped checkpoint) are in the layout map,
``docs/architecture.md``. Nothing here imports an engine or the server: the
engine is ``trio_vstream.engines.shapes``, and what runs it for an evaluation
is in ``bench/``.
"""

"""A small chunk-autoregressive video diffusion model of a simple world.

One object (8 colours, 3 shapes, 2 sizes) moves left, right, up, down or
stays still on a plain background (5 colours), in a 32x32 world that wraps
at the edges. Modules: ``vocab`` (vocabulary and prompt parser), ``render``
(the procedural renderer that makes the training data), ``model`` (slot
encoder and denoiser UNet, weights I/O), ``sampler`` (few-step flow-matching
sampling with guidance), ``train`` (the training entry point) and
``evaluate`` (judging decoded frames against a prompt, and the prompt sets).
Nothing here imports an engine or the server: the engine is
``trio_vstream.engines.shapes``, and what runs it for an evaluation is in
``bench/``. The shipped checkpoint is
``weights.safetensors`` (with ``weights.json``: settings and metrics).
"""

"""A small chunk-autoregressive video diffusion model of a simple world.

One object (8 colours, 3 shapes, 2 sizes) moves left, right, up, down or
stays still on a plain background (5 colours), in a 32x32 world that wraps
at the edges. Modules: ``vocab`` (vocabulary and prompt parser), ``render``
(the procedural renderer that makes the training data), ``model`` (slot
encoder and denoiser UNet, weights I/O), ``sampler`` (few-step flow-matching
sampling with guidance), ``train`` (the training entry point) and
``evaluate`` (the quality evaluator). The engine is
``trio_vstream.engines.shapes``; the shipped checkpoint is
``weights.safetensors`` (with ``weights.json``: settings and metrics).
"""

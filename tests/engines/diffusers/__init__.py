"""Tests of ``trio_vstream.engines.diffusers``, one module per engine module."""

"""Models that ship with trio_vstream.

``shapes`` is a toy-scale chunk-autoregressive video diffusion model of a
simple world (one object on a plain background), small enough to train on a
laptop CPU and to stream in real time without a GPU. It exists so that the
default server generates real diffusion video anywhere, with no download.
"""

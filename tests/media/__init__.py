"""Frames and images in and out: the fMP4 encoder, image headers, image URLs."""

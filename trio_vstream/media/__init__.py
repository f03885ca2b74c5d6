"""Bytes of video and sound: fragmented MP4, codecs, images.

``encoding`` turns frames and PCM into fMP4 chunks (H.264 and AAC); ``image_header``
reads an image's dimensions from its header before anything decodes it;
``image_fetch`` fetches an image a request names, confined and bounded.
"""

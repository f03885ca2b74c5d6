"""Bytes of video and sound: fragmented MP4, codecs, images.

``encoding`` turns frames and PCM into fMP4 chunks (`FragmentedMP4Encoder`), composing
``h264`` (libx264 through PyAV: its settings, frames in, MP4 samples and the ``avcC``
record out) and ``aac`` (AAC-LC through PyAV, its FIFO and priming) with ``fmp4``, the
sans-IO box writer (samples and counters in, ``ftyp``/``moov``, ``moof``/``mdat`` and
``mfra`` bytes out; it also reads a fragment's first sample back). ``errors`` holds
`EncodingError`, which they all raise. ``image_header`` reads an image's dimensions from
its header before anything decodes it; ``image_decode`` decodes it once vetted;
``image_fetch`` fetches an image a request names, confined and bounded. ``remux`` turns
the fMP4 stream into a progressive MP4, and a progressive MP4 back into fragments, one
per keyframe (a recording played as HLS).
"""

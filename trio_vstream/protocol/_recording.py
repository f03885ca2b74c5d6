"""What marks a recording's JSON: its format name and versions.

The server writes recordings (`trio_vstream.outputs.recording`) and the client's
``replay`` reads them (`trio_vstream.client`). Both speak of these values, as both
speak the wire, so they live with the protocol; neither side imports the other.
"""

from typing import Final

__all__ = ["RECORDING_FORMAT", "RECORDING_FORMAT_VERSION", "RECORDING_READABLE_VERSIONS"]

RECORDING_FORMAT: Final = "trio_vstream.recording"
"""The JSON's ``format`` field: what tells a recording from any other JSON file."""

RECORDING_FORMAT_VERSION: Final = 2
"""The JSON's ``version``: raised on any change a reader of older files would misread.
Version 2 added ``"truncated"`` (``--record-max-bytes``): a version-1 reader would take
a truncated recording for a complete one whose replay then "differs"."""

RECORDING_READABLE_VERSIONS: Final = (1, 2)
"""The versions ``replay`` reads: a version-1 file is a version-2 file that was never
truncated (it has no ``"truncated"``, which reads as false)."""

"""The client library and its command lines (``trio_vstream.client``)."""

"""The wire protocol, sans-IO (``trio_vstream.protocol``): text in, messages and events out."""

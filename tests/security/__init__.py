"""Attack tests: one for each thing a client, a viewer or a recording can set (SECURITY.md)."""

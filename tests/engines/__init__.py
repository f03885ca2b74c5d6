"""The engine contract and the built-in engines: synthetic, shapes, batching, the kit."""

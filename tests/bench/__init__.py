"""The bench/ tools: the benchmark harness, the soak, the fuzz, the GPU check."""

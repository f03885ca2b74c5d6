"""Benchmark harness (``python bench/run.py``); a package so that tests can import it."""

"""Benchmarks: ``python -m bench NAME [options]``; each prints figures and a ratio against a
baseline measured in the same run. Never timed assertions in tests."""

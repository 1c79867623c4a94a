"""Benchmarks: `invoke bench` (or `python -m bench.run`) measures speed and robustness side by side."""

"""Benchmark harness: ``python -m benchmarks.run --suite ... --out results.json``."""

"""Benchmarks of trainer3d against theory and peers (see bench/README.md). A package so that tests can reuse the
measurement code (bench.harness, bench.measure)."""

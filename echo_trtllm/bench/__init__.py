"""Benchmarks, workloads and metrics."""

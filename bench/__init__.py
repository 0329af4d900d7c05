"""Serving benchmarks: workloads, vLLM-style metrics, side-by-side runs, plots, a P:D planner."""

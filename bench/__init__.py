"""Benchmarks: each module measures one target and prints a JSON result."""

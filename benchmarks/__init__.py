"""Benchmarks: ratios and medians measured side by side in one run (never gated in tests)."""

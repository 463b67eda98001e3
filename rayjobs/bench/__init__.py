"""Benchmarks: each a command (``rayjobs bench ...``) that reports ratios measured in one run."""

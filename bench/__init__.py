"""Benchmarks of the outbox and its relay, each reported as a ratio against a baseline measured
in the same run (``python -m bench --help``). The targets: docs/design.md, "Performance targets"."""

"""Benchmarks of the outbox and its relay, each reported as a ratio against a baseline measured
in the same run (``python -m bench --help``). See DESIGN.md section 7 for the targets."""

"""Benchmarks (scripts, not tests): `python -m mtpkit.bench.decode_step`."""

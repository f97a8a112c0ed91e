"""Benchmarks of the Ember FaaS runtime and its tensor pool.

Each benchmark is a module runnable as ``python -m bench.NAME``. It measures its baseline in
the same run, prints exactly one JSON line on stdout with the figures, the ratios to the
baseline, the target(s) and a boolean ``"pass"``, and accepts ``--quick`` for a smaller
run. Benchmarks are deterministic where they can be (fixed, reported seeds); timings are
wall-clock and depend on the machine.
"""

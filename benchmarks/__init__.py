"""Benchmarks; installed as flint_sched.benchmarks."""

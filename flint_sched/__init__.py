"""flint-sched: a serving engine for the Flint mixture-of-experts model."""

__version__ = "0.1.0"

"""Every environment variable flint-sched reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where generated checkpoints are kept: $FLINT_SCHED_CACHE, else $XDG_CACHE_HOME/flint-sched."""
    explicit = os.environ.get("FLINT_SCHED_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flint-sched"


def hf_hub_offline() -> bool:
    """$HF_HUB_OFFLINE (as huggingface_hub reads it): use the hub cache only, never the network."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")

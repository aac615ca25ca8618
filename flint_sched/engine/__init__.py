"""The asyncio engine loop, its outputs, and how to build one from an EngineConfig."""

from flint_sched.engine.async_engine import AsyncEngine
from flint_sched.engine.config import EngineConfig
from flint_sched.engine.outputs import CompletionOutput, EngineError, RequestOutput

__all__ = ["AsyncEngine", "CompletionOutput", "EngineConfig", "EngineError", "RequestOutput"]

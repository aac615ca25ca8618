"""The scheduler and the hybrid KV allocator: pure Python bookkeeping, never imports torch."""

from flint_sched.core.kv_allocator import HybridKVAllocator, IdPool, KVAllocation
from flint_sched.core.plan import (
    ExecutionPath,
    RequestStepOutput,
    ScheduledRequest,
    StepPlan,
    StepResult,
)
from flint_sched.core.request import FinishReason, Request, RequestStatus
from flint_sched.core.scheduler import Scheduler
from flint_sched.core.scheduler_config import SchedulerConfig

__all__ = [
    "ExecutionPath",
    "FinishReason",
    "HybridKVAllocator",
    "IdPool",
    "KVAllocation",
    "Request",
    "RequestStatus",
    "RequestStepOutput",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "StepPlan",
    "StepResult",
]

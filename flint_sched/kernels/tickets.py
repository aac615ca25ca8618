"""How the kernels' "last CTA finishes" tickets and grid-wide counters order memory (cuda/common.cuh
ticket_arrive / ticket_acquire): the decode attention's split merge, the argmax and the LM head's
own argmax; on the grouped path the ticket router, moe_routing's sort, the decode experts' per-item
counts and the fence before their cluster barrier.

ACQ_REL False: the counting thread runs __threadfence() (fence.sc.gpu, MEMBAR.SC.GPU) before a
relaxed atomicAdd, and the last CTA a second one before it reads. True: one atomic with release and
acquire semantics (MEMBAR.ALL.GPU before it, no fence after), the order cutlass's semaphores use.
The same values either way (tests/gpu/test_ticket_ordering.py); True measured ~1 % faster decode steps
at 1-16 requests (benchmarks/RESULTS.md, session 35). Launchers read it at each launch (`defines`),
so an A/B variant (benchmarks/ab_decode.py `flint_sched.kernels.tickets.ACQ_REL=False`) compiles its
own kernels.
"""

from __future__ import annotations

ACQ_REL = True


def defines() -> tuple[tuple[str, int], ...]:
    """The compile define of the kernels that take tickets."""
    return (("TICKET_ACQ_REL", int(ACQ_REL)),)

"""How kvt's latency-critical threads are scheduled: first in the fair class,
never real-time.

Theory of operation
-------------------
kvt's owner thread (and the benchmarks' watcher threads) share a pinned core
with the engine's forward. A woken thread at the default priority waits for
the running thread's slice under Linux's EEVDF scheduler (~3 ms: `layer_done`
-> send at 1-3 ms p50, 5-11 ms p99). `boost_current_thread` puts the calling
thread at nice `BOOST_NICE` (-20) in the fair class: EEVDF then picks it at its
wake-up, ahead of the forward (measured on this machine kind: wake-up latency
on a core busy with another process's compute p50 0.05 ms, p99 0.11-0.13 ms,
the same as ``SCHED_FIFO``'s 0.05 / 0.11 ms; nice 0: p99 1.8-2.8 ms).

Why not real-time. A ``SCHED_FIFO`` thread that busy-waits, even once and for a
reason outside our code (a library spinning on a lock that a preempted thread
of its core holds), takes the whole core until the kernel's real-time
throttling stops it: on these kernels (``sched_rt_runtime_us`` 950000 of
1000000, fair server) every other thread of that core then runs 50 ms of each
second. The router, the API server and the client on that core wait about a
second at each hop: the one-second gaps users saw. Measured here: a thread
sleeping 5 ms in a loop beside a spinning ``SCHED_FIFO`` thread on its core saw
a gap of 954 ms; beside the same spin at nice -20, 7.6 ms (the fair class
gives the sleeper its turn at its wake-up). `tests/kvt/test_priority.py` checks
this on the kvt owner itself.

Rules:
- The policy carries ``SCHED_RESET_ON_FORK``: a thread started from a boosted
  thread (UCX, NIXL, OpenMP, the TCP transport) starts at nice 0.
- Without the privilege (``CAP_SYS_NICE``) the thread stays as it was and the
  caller is told why (it logs a warning): slower sends, nothing else.
"""

from __future__ import annotations

import os
import threading

BOOST_NICE = -20


def boost_current_thread() -> str | None:
    """Run the calling thread at nice `BOOST_NICE` in the fair class
    (``SCHED_OTHER | SCHED_RESET_ON_FORK``); None if done, else why not."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER | os.SCHED_RESET_ON_FORK, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, BOOST_NICE)
    except (OSError, AttributeError) as e:
        return str(e)
    return None

"""In-process helpers: P ranks as threads over ThreadTransport."""
from __future__ import annotations

import threading

from hvd_zoadam.transport import ThreadGroup


def run_threads(world_size: int, fn, timeout_s: float = 60.0) -> list:
    """Run ``fn(rank, transport)`` on ``world_size`` thread-ranks; return their results in rank order.

    An exception on any rank is re-raised here (the others are released by the barrier timeout).
    """
    group = ThreadGroup(world_size, timeout_s=timeout_s)
    results, errors = [None] * world_size, [None] * world_size

    def body(rank, transport):
        try:
            results[rank] = fn(rank, transport)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[rank] = exc
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r, t), daemon=True) for r, t in enumerate(group.transports())]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
        if t.is_alive():
            raise TimeoutError(f"a thread-rank did not finish within {timeout_s}s")
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    if any(errors):
        raise next(e for e in errors if e is not None)
    return results

"""kvq.vllm's save queue: the engine's saves run in order on one background thread, so that a
step hands its saves over and goes on; the K/V the queued saves hold are bounded in bytes, and
a save that would go past the bound is dropped and counted (a later request with that prefix
recomputes it: a miss, never an error). Needs no vLLM (the connector builds on it).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Deque, Dict, Tuple

__all__ = ["SaveQueue"]

log = logging.getLogger("kvq.vllm")


class SaveQueue:
    """Runs submitted saves (callables) one at a time, oldest first, on a daemon thread.

    limit_bytes bounds the bytes of the saves submitted and not yet finished (the one running
    included). A save that would go past it is refused, unless nothing is pending (so a single
    save larger than the limit still runs when it is alone). A save that raises is logged and
    counted; the queue goes on.
    """

    def __init__(self, limit_bytes: int, name: str = "kvq-save") -> None:
        if limit_bytes <= 0:
            raise ValueError(f"SaveQueue: limit_bytes must be > 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._queue: Deque[Tuple[Callable[[], None], int]] = collections.deque()
        self._cv = threading.Condition()
        self._pending_bytes = 0
        self._running = False
        self._closed = False
        # submitted, dropped, done, failed: counts of saves; peak_bytes: the most ever pending.
        self.counts: Dict[str, int] = {"submitted": 0, "dropped": 0, "done": 0, "failed": 0, "peak_bytes": 0}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        with self._cv:
            return self._pending_bytes

    def submit(self, save: Callable[[], None], nbytes: int) -> bool:
        """Queues `save` (holding nbytes of K/V); False, counted as dropped, when that would go
        past the limit. Never waits."""
        with self._cv:
            if self._closed:
                raise RuntimeError("SaveQueue: submit after close")
            if self._pending_bytes > 0 and self._pending_bytes + nbytes > self.limit_bytes:
                self.counts["dropped"] += 1
                return False
            self._queue.append((save, nbytes))
            self._pending_bytes += nbytes
            self.counts["submitted"] += 1
            self.counts["peak_bytes"] = max(self.counts["peak_bytes"], self._pending_bytes)
            self._cv.notify_all()
            return True

    def flush(self, timeout: float) -> bool:
        """Waits up to timeout seconds for every submitted save to finish; True if they did."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._running:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def close(self, timeout: float) -> bool:
        """Flushes (up to timeout seconds), then stops the thread; saves still queued after the
        timeout are abandoned (the thread is a daemon). True if every save finished."""
        done = self.flush(timeout)
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify_all()
        self._thread.join(timeout=0.1)
        return done

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                save, nbytes = self._queue.popleft()
                self._running = True
            try:
                save()
                ok = True
            except Exception:  # a save's failure is the save's; the queue goes on
                log.exception("kvq.vllm: a queued save failed")
                ok = False
            with self._cv:
                self._pending_bytes -= nbytes
                self._running = False
                self.counts["done" if ok else "failed"] += 1
                self._cv.notify_all()

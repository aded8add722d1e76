"""One engine step's loads on a thread of their own, each layer released to the forward pass as
soon as every load has written it (vLLM's wait_for_layer_load), so that reading and decoding
later layers overlaps the compute of earlier ones.

The jobs run one after the other; each reports the layers it has written whole
(`layer_written`), and a job that ends (done or failed) releases the layers it did not report.
A waiter that gives up cancels the step: `writing()` then refuses every later write, and
cancel() returns only once no write is in progress, so nothing is written into the paged cache
after its waiter has moved on.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, List, Optional, Set


class StepCancelled(RuntimeError):
    """Raised by writing() once a waiter has given up on the step."""


class LayerLoads:
    """The loads of one step (see the module's doc)."""

    def __init__(self, layers: int, jobs: List[Callable[[LayerLoads], None]], name: str = "kvq-load") -> None:
        self._layers = layers
        self._jobs = list(jobs)
        self._reached = [0] * layers  # jobs past each layer (written or given up)
        self._marked: Set[int] = set()  # the running job's reported layers
        self._cond = threading.Condition()
        self._write = threading.Lock()
        self._cancelled = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for job in self._jobs:
            try:
                job(self)
            except Exception:  # a job reports its own errors; one that escapes only ends it
                pass
            finally:
                with self._cond:
                    for layer in range(self._layers):
                        if layer not in self._marked:
                            self._reached[layer] += 1
                    self._marked = set()
                    self._cond.notify_all()

    def layer_written(self, layer: int) -> None:
        """The running job has written every token it loads of `layer`."""
        with self._cond:
            if layer not in self._marked:
                self._marked.add(layer)
                self._reached[layer] += 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Held around each write into the cache; raises StepCancelled once cancelled."""
        with self._write:
            if self._cancelled:
                raise StepCancelled("the forward pass stopped waiting for this step's loads")
            yield

    def wait(self, layer: int, timeout: Optional[float]) -> bool:
        """Until every job is past `layer`; False (and the step cancelled) after `timeout` s."""
        with self._cond:
            ready = self._cond.wait_for(lambda: self._reached[layer] >= len(self._jobs), timeout)
        if not ready:
            self.cancel()
        return ready

    def cancel(self) -> None:
        """No write starts after this returns, and none is in progress."""
        with self._write:
            self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def join(self, timeout: Optional[float]) -> bool:
        """Waits for the jobs to end; False when they are still running after `timeout` s (the
        step is then cancelled: they write nothing more)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.cancel()
            return False
        return True

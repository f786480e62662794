"""Turns on shared cores: node processes that compute on the same CPU cores take turns, one
engine step at a time, each step with every core, instead of all computing at once.

Why: each step is a few hundred short parallel loops, and a loop ends when its slowest thread
ends. Two nodes with a thread per core each on one machine (`pdserve serve`'s default 1 prefill
+ 1 decode node on a laptop) put two threads on every core, so a loop waits for a descheduled
thread's time slice again and again, and the idle workers of one node cannot spin without taking
the other's core. Taking turns, a step runs as if its node were alone, and its kernel pool may
spin inside the step (pdserve_kernels/cpu/thread_pool.h). SmolLM2 bf16 on 2 cores, 1 + 1 nodes,
issue 17's serving workload: README, "Turns on shared cores".

The turn is an exclusive flock() on a lock file. A second file is a turnstile in front of it: a
node takes the turnstile, then the lock, then lets the turnstile go, so a node that just ended a
step queues behind one already waiting for the lock (it holds the turnstile) and the nodes
alternate when all are busy: a prefill node with a backlog cannot starve a decode node, nor the
other way round. flock() locks die with their process, so a killed node never leaves the lock
held. The files hold no data.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

TURNSTILE_SUFFIX = ".turnstile"


class CoreTurns:
    """Turns on one lock file, shared by the node processes on the same cores."""

    def __init__(self, path: str) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(directory):
            raise ValueError(f"shared cores lock {path}: no directory {directory}")
        self.path = path
        self._fds: list[int] = []
        try:
            for name in (path + TURNSTILE_SUFFIX, path):
                self._fds.append(os.open(name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        except OSError as exc:
            self.close()
            raise ValueError(f"shared cores lock {path}: {exc.strerror}") from exc
        self._turnstile, self._lock = self._fds

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Inside: this process's turn on the cores (blocks until the others' steps end)."""
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

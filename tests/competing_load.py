"""Competing load: processes that keep cores busy while a test or a
benchmark runs, as a camera, an app or other people's jobs do on a board.

    with CompetingLoad(2):
        ...  # two spinning processes share the cores with this code

Each spinner is a separate process, started and stopped by its pid; the
context waits (with a deadline) until every one has been seen running, so
the load is there before the code inside starts.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

# A spinner: nothing but a busy loop (no output, no memory).
SPIN = "while True:\n    pass\n"


def cores() -> int:
    """Cores this process may run on (every core the load should cover)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_ticks(pid: int) -> int:
    """User plus system CPU time of a process so far, in clock ticks
    (fields 14 and 15 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


class CompetingLoad:
    """`count` spinning processes for the duration of a with block."""

    def __init__(self, count: int, timeout: float = 30.0):
        self.count = count
        self.timeout = timeout
        self.processes: list = []

    def __enter__(self) -> "CompetingLoad":
        try:
            for _ in range(self.count):
                self.processes.append(subprocess.Popen([sys.executable, "-c", SPIN],
                                                       stdin=subprocess.DEVNULL))
            self._wait_until_spinning()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_until_spinning(self) -> None:
        deadline = time.monotonic() + self.timeout
        pending = {p.pid: p for p in self.processes}
        seen: dict = {}
        while pending:
            for pid, process in list(pending.items()):
                if process.poll() is not None:
                    raise RuntimeError(f"spinner {pid} ended with status {process.returncode}")
                seen[pid] = cpu_ticks(pid)
                if seen[pid] > 0:
                    del pending[pid]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"spinners {sorted(pending)} did not run within {self.timeout} s "
                                   f"(CPU ticks seen: {seen})")
            if pending:
                time.sleep(0.01)

    def stop(self) -> None:
        """Stop every spinner by its pid and reap it."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.wait(timeout=30)
        self.processes = []

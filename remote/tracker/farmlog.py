"""What happened in a farm lately, and the counts its metrics are made of.

The tracker records here as it grants, ends and evicts; the farm page and
``/metrics`` (remote/tracker/web.py) read it. Plain data, no I/O: recording
costs a few appends under the caller's lock.
"""
from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from typing import Dict, List, Tuple

# Histogram buckets (seconds): a lease wait is milliseconds to minutes, a
# session seconds to hours.
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800)
SESSION_BUCKETS = (0.1, 1, 5, 10, 30, 60, 300, 600, 1800, 3600, 4 * 3600)
KEPT_EVENTS = 200
KEPT_BENCH = 500


class Histogram:
    """Counts per bucket, with the sum, as Prometheus histograms keep them."""

    def __init__(self, buckets: Tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def cumulative(self) -> List[Tuple[str, int]]:
        out, running = [], 0
        for bound, count in zip(list(self.buckets) + [float("inf")], self.counts):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
        return out


class FarmLog:
    def __init__(self, clock=time.time):
        self._clock = clock
        self._lock = threading.Lock()
        self.events = deque(maxlen=KEPT_EVENTS)      # (unix time, kind, text)
        self.sessions = deque(maxlen=KEPT_EVENTS)    # recent ended leases
        self.bench = deque(maxlen=KEPT_BENCH)        # posted `tether bench --json` reports
        self.lease_wait: Dict[str, Histogram] = {}
        self.session_length: Dict[str, Histogram] = {}
        self.sessions_total: Dict[str, int] = {}
        self.evictions_total: Dict[str, int] = {}

    def event(self, kind: str, text: str) -> None:
        with self._lock:
            self.events.append((self._clock(), kind, text))

    def granted(self, key: str, waited_s: float) -> None:
        with self._lock:
            self.lease_wait.setdefault(key, Histogram(WAIT_BUCKETS)).observe(max(waited_s, 0.0))

    def ended(self, key: str, device_id: str, holder: str, held_s: float, how: str) -> None:
        with self._lock:
            self.session_length.setdefault(key, Histogram(SESSION_BUCKETS)).observe(held_s)
            self.sessions_total[key] = self.sessions_total.get(key, 0) + 1
            self.sessions.append({"time": self._clock(), "key": key, "device_id": device_id,
                                  "holder": holder, "held_s": held_s, "how": how})

    def evicted(self, key: str, device_id: str, why: str) -> None:
        with self._lock:
            self.evictions_total[key] = self.evictions_total.get(key, 0) + 1
        self.event("eviction", f"{device_id} ({key}): {why}")

    def add_bench(self, report: dict) -> None:
        with self._lock:
            self.bench.append({"time": self._clock(), "report": report})

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "events": [{"time": t, "kind": k, "text": x} for t, k, x in self.events],
                "sessions": list(self.sessions),
                "bench": list(self.bench),
            }

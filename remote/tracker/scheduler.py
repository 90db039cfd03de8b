"""The tracker's pool of devices, queue of requests and leases, as plain data.

No sockets, threads, clocks or randomness: every method that depends on time
takes ``now``, and lease tokens come from the ``new_token`` callable given to
the constructor. The gRPC shell in ``service.py`` owns the lock and the clock.

    >>> s = Scheduler(new_token=iter(["t1", "t2"]).__next__)
    >>> _ = s.register("d1", "rasp4b64", "10.0.0.5:9090", {}, now=0.0)
    >>> s.enqueue(Request("r1", "rasp4b64", priority=0, client="ci", enqueued_at=1.0))
    >>> [(r.request_id, lease.token) for r, lease in s.assign(now=1.0)]
    [('r1', 't1')]
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

FREE, LEASED, IN_USE = "free", "leased", "in_use"
RESUMED_HOLDER = "(a session from before the device registered again)"


@dataclass
class Device:
    device_id: str
    key: str
    address: str
    attributes: Dict[str, str]
    registered_at: float
    last_seen: float
    lease: Optional["Lease"] = None
    free_since: float = 0.0

    @property
    def state(self) -> str:
        if self.lease is None:
            return FREE
        return IN_USE if self.lease.redeemed_at is not None else LEASED


@dataclass
class Request:
    request_id: str
    key: str
    priority: int = 0
    client: str = ""
    enqueued_at: float = 0.0
    filters: Dict[str, str] = field(default_factory=dict)


@dataclass
class Lease:
    token: str
    device_id: str
    client: str
    granted_at: float
    redeemed_at: Optional[float] = None


class LeaseRefused(Exception):
    """A lease token that is unknown, for another device, or already redeemed."""


class Scheduler:
    """Devices by id, waiting requests by key, leases by token."""

    def __init__(self, new_token: Callable[[], str], unused_lease_s: float = 30.0):
        self._new_token = new_token
        self.unused_lease_s = unused_lease_s
        self.devices: Dict[str, Device] = {}
        self.leases: Dict[str, Lease] = {}
        # Free devices per key, longest free first (dicts keep insertion order):
        # a grant looks at the few devices at the front, not the whole farm.
        self._free: Dict[str, Dict[str, Device]] = {}
        self._per_key: Dict[str, int] = {}  # devices registered under each key
        self._waiting: Dict[str, Tuple[int, Request]] = {}  # request_id -> (seq, request)
        self._seq = itertools.count()

    # ----------------------------------------------------------- devices --
    def register(self, device_id: str, key: str, address: str,
                 attributes: Dict[str, str], now: float,
                 live_tokens: Sequence[str] = ()) -> Device:
        """Add a device, or refresh one that registers again under the same id.

        ``live_tokens`` are leases whose sessions are still open on the device
        (it registers again after a tracker restart): they stay in use, so the
        device is not leased to anyone else until they are released.
        """
        old = self.devices.get(device_id)
        device = Device(device_id, key, address, dict(attributes), now, now, free_since=now)
        if old is not None and old.lease is not None:
            if old.key == key and old.lease.token in live_tokens:
                device.lease = old.lease  # the session survives the re-registration
            else:
                self.leases.pop(old.lease.token, None)
        if device.lease is None and live_tokens:
            lease = Lease(live_tokens[0], device_id, RESUMED_HOLDER, now, redeemed_at=now)
            self.leases[lease.token] = device.lease = lease
        if old is not None:
            self._taken(old)
            self._count(old.key, -1)
        self.devices[device_id] = device
        self._count(key, +1)
        if device.lease is None:
            self._freed(device)
        return device

    def _count(self, key: str, change: int) -> None:
        count = self._per_key.get(key, 0) + change
        if count:
            self._per_key[key] = count
        else:
            self._per_key.pop(key, None)

    def serves(self, key: str) -> bool:
        return key in self._per_key

    def _freed(self, device: Device) -> None:
        self._free.setdefault(device.key, {})[device.device_id] = device

    def _taken(self, device: Device) -> None:
        pool = self._free.get(device.key)
        if pool is not None and pool.get(device.device_id) is device:
            del pool[device.device_id]
            if not pool:
                del self._free[device.key]

    def heartbeat(self, device_id: str, now: float) -> bool:
        device = self.devices.get(device_id)
        if device is None:
            return False
        device.last_seen = now
        return True

    def remove(self, device_id: str) -> Optional[Device]:
        device = self.devices.pop(device_id, None)
        if device is not None:
            self._taken(device)
            self._count(device.key, -1)
            if device.lease is not None:
                self.leases.pop(device.lease.token, None)
        return device

    def evict_silent(self, now: float, window_s: float) -> List[Device]:
        """Remove every device not heard from within ``window_s``."""
        silent = [d for d in self.devices.values() if now - d.last_seen > window_s]
        for device in silent:
            self.remove(device.device_id)
        return silent

    def served_keys(self) -> List[str]:
        return sorted(self._per_key)

    # ----------------------------------------------------------- requests --
    def enqueue(self, request: Request) -> None:
        self._waiting[request.request_id] = (next(self._seq), request)

    def cancel(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def waiting(self) -> List[Request]:
        """Waiting requests in the order they will be served within each key."""
        ordered = sorted(self._waiting.values(), key=lambda sr: (-sr[1].priority, sr[0]))
        return [request for _, request in ordered]

    def assign(self, now: float) -> List[Tuple[Request, Lease]]:
        """Lease free devices to waiting requests: priority first, then arrival."""
        granted: List[Tuple[Request, Lease]] = []
        if not self._waiting:
            return granted
        # The device idle longest goes first, so use spreads over the pool.
        for request in self.waiting():
            pool = self._free.get(request.key)
            if not pool:
                continue
            device = next((d for d in pool.values() if all(
                d.attributes.get(k) == v for k, v in request.filters.items())), None)
            if device is None:
                continue
            self._taken(device)
            lease = Lease(self._new_token(), device.device_id, request.client, now)
            device.lease = lease
            self.leases[lease.token] = lease
            self.cancel(request.request_id)
            granted.append((request, lease))
        return granted

    # ------------------------------------------------------------- leases --
    def redeem(self, device_id: str, token: str, now: float) -> Lease:
        """Mark a lease in use when its client reaches the device; once only."""
        lease = self.leases.get(token)
        if lease is None or lease.device_id != device_id:
            raise LeaseRefused("unknown or expired lease token for this device")
        if lease.redeemed_at is not None:
            raise LeaseRefused("lease token already used")
        lease.redeemed_at = now
        return lease

    def release(self, token: str, now: float) -> Optional[Device]:
        """End a lease; the device becomes free. Unknown tokens are ignored."""
        lease = self.leases.pop(token, None)
        if lease is None:
            return None
        device = self.devices.get(lease.device_id)
        if device is not None and device.lease is lease:
            device.lease = None
            device.free_since = now
            self._freed(device)
        return device

    def expire_unused(self, now: float) -> List[Lease]:
        """Release leases whose client never reached the device in time."""
        stale = [lease for lease in self.leases.values()
                 if lease.redeemed_at is None and now - lease.granted_at > self.unused_lease_s]
        for lease in stale:
            self.release(lease.token, now)
        return stale

    # ------------------------------------------------------------ summary --
    def summary(self, now: float) -> dict:
        """Devices, per-key counts and the queue, as plain data."""
        devices = []
        for d in sorted(self.devices.values(), key=lambda d: (d.key, d.device_id)):
            devices.append({
                "device_id": d.device_id, "key": d.key, "address": d.address,
                "state": d.state,
                "holder": d.lease.client if d.lease else "",
                "held_s": now - d.lease.granted_at if d.lease else 0.0,
                "last_seen_s": now - d.last_seen,
            })
        waiting = self.waiting()
        keys = []
        for key in sorted({d.key for d in self.devices.values()} | {r.key for r in waiting}):
            pool = [d for d in self.devices.values() if d.key == key]
            keys.append({
                "key": key, "total": len(pool),
                "free": sum(1 for d in pool if d.lease is None),
                "pending": sum(1 for r in waiting if r.key == key),
            })
        queue = [{"key": r.key, "priority": r.priority, "client": r.client,
                  "waited_s": now - r.enqueued_at} for r in waiting]
        return {"devices": devices, "keys": keys, "waiting": queue}

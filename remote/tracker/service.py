"""The tracker's gRPC shell around the pure scheduler.

One lock guards the scheduler. A ``RequestDevice`` call enqueues a request and
waits on its own event until the scheduler grants a lease, the deadline passes,
or the client goes away (then the request leaves the queue).
"""
from __future__ import annotations

import hmac
import itertools
import logging
import os
import secrets
import threading
import time
from concurrent import futures
from typing import Dict, Optional

import grpc

from remote import errors, tls
from remote.defaults import FARM_SECRET_ENV, TRACKER_PORT
from remote.errors import AuthenticationError, NoSuchKey, RequestTimeout, abort
from remote.proto import CHANNEL_OPTIONS, add_servicer, pb
from remote.tracker.scheduler import LeaseRefused, Request, Scheduler

log = logging.getLogger("tether.tracker")

EVICTION_WINDOW_S = 5.0
UNUSED_LEASE_S = 30.0
# Each waiting RequestDevice call holds one worker thread, so the pool is large;
# threads are only started as calls arrive.
MAX_WORKERS = 1024


def heartbeat_interval(eviction_window_s: float) -> float:
    """Heartbeat often enough that a live device misses several before eviction."""
    return max(0.05, min(1.0, eviction_window_s / 4))


class _Waiter:
    def __init__(self):
        self.event = threading.Event()
        self.lease = None


class TrackerService:
    """Implements the tether.v1.Tracker service."""

    def __init__(self, farm_secret: str = "", eviction_window_s: float = EVICTION_WINDOW_S,
                 unused_lease_s: float = UNUSED_LEASE_S, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._scheduler = Scheduler(new_token=lambda: secrets.token_urlsafe(24),
                                    unused_lease_s=unused_lease_s)
        self._infos: Dict[str, object] = {}       # device_id -> pb.DeviceInfo
        self._waiters: Dict[str, _Waiter] = {}    # request_id -> waiter
        self._ids = itertools.count(1)
        self._farm_secret = farm_secret
        self.eviction_window_s = eviction_window_s
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="tracker-reaper", daemon=True)
        self._reaper.start()

    def close(self):
        self._stop.set()

    # ---------------------------------------------------------- plumbing --
    def _check_secret(self, context, given: str):
        if self._farm_secret and not hmac.compare_digest(given.encode(), self._farm_secret.encode()):
            abort(context, AuthenticationError(
                f"wrong or missing farm secret; pass --farm-secret or set {FARM_SECRET_ENV}"))

    def _dispatch_locked(self):
        for request, lease in self._scheduler.assign(self._clock()):
            waiter = self._waiters.pop(request.request_id, None)
            if waiter is None:  # the requester left between enqueue and grant
                self._scheduler.release(lease.token, self._clock())
                continue
            waiter.lease = lease
            waiter.event.set()

    def _reap_loop(self):
        while not self._stop.wait(min(0.5, self.eviction_window_s / 4)):
            with self._lock:
                now = self._clock()
                for device in self._scheduler.evict_silent(now, self.eviction_window_s):
                    log.warning("evicted %s (%s at %s): no heartbeat for %.1f s",
                                device.device_id, device.key, device.address, now - device.last_seen)
                    self._infos.pop(device.device_id, None)
                for lease in self._scheduler.expire_unused(now):
                    log.info("lease on %s expired unused", lease.device_id)
                self._dispatch_locked()

    # -------------------------------------------------------------- RPCs --
    def Register(self, request, context):
        self._check_secret(context, request.farm_secret)
        if not request.key or not request.address:
            abort(context, errors.InvalidArgument("registration needs a key and an address"))
        with self._lock:
            device_id = request.device_id or f"{request.key}-{next(self._ids)}-{secrets.token_hex(3)}"
            self._scheduler.register(device_id, request.key, request.address,
                                     dict(request.info.attributes), self._clock(),
                                     live_tokens=list(request.live_tokens))
            self._infos[device_id] = request.info
            self._dispatch_locked()
        log.info("registered %s (%s at %s)", device_id, request.key, request.address)
        return pb.RegisterReply(device_id=device_id, heartbeat_interval_s=heartbeat_interval(self.eviction_window_s))

    def Heartbeat(self, request, context):
        self._check_secret(context, request.farm_secret)
        with self._lock:
            known = self._scheduler.heartbeat(request.device_id, self._clock())
        return pb.HeartbeatReply(known=known)

    def RequestDevice(self, request, context):
        self._check_secret(context, request.farm_secret)
        request_id = f"r{next(self._ids)}"
        waiter = _Waiter()
        with self._lock:
            served = self._scheduler.served_keys()
            if request.key not in served and not request.wait_for_key:
                abort(context, NoSuchKey(
                    f"no device registered under key {request.key!r}; registered keys: "
                    f"{', '.join(served) if served else '(none)'}"))
            self._waiters[request_id] = waiter
            self._scheduler.enqueue(Request(request_id, request.key, request.priority,
                                            request.client or context.peer(), self._clock(),
                                            dict(request.filters)))
            self._dispatch_locked()
        # The client went away: stop waiting. add_callback returns False when the
        # call has already ended, and then the callback would never run.
        if not context.add_callback(waiter.event.set):
            waiter.event.set()
        timeout = request.timeout_s if request.timeout_s > 0 else None
        waiter.event.wait(timeout)
        with self._lock:
            if waiter.lease is None:
                self._waiters.pop(request_id, None)
                self._scheduler.cancel(request_id)
        lease = waiter.lease
        if lease is None:
            if not context.is_active():
                return pb.Lease()
            abort(context, RequestTimeout(
                f"no device of key {request.key!r} became free within {request.timeout_s:g} s"))
        with self._lock:
            device = self._scheduler.devices.get(lease.device_id)
            if device is None or not context.is_active():
                # The client left, or the device vanished, while the lease was granted.
                self._scheduler.release(lease.token, self._clock())
                self._dispatch_locked()
                if device is None:
                    abort(context, errors.ConnectionFailed(
                        f"device {lease.device_id} disappeared while being leased; request again"))
                return pb.Lease()
            reply = pb.Lease(token=lease.token, device_id=lease.device_id,
                             address=device.address, key=device.key)
            if lease.device_id in self._infos:
                reply.info.CopyFrom(self._infos[lease.device_id])
        return reply

    def RedeemLease(self, request, context):
        self._check_secret(context, request.farm_secret)
        with self._lock:
            try:
                self._scheduler.redeem(request.device_id, request.token, self._clock())
            except LeaseRefused as exc:
                abort(context, AuthenticationError(str(exc)))
        return pb.Empty()

    def ReleaseLease(self, request, context):
        self._check_secret(context, request.farm_secret)
        with self._lock:
            self._scheduler.release(request.token, self._clock())
            self._dispatch_locked()
        return pb.Empty()

    def Summary(self, request, context):
        with self._lock:
            data = self._scheduler.summary(self._clock())
            infos = dict(self._infos)
        reply = pb.TrackerSummary()
        for d in data["devices"]:
            status = reply.devices.add(**d)
            if d["device_id"] in infos:
                status.info.CopyFrom(infos[d["device_id"]])
        for k in data["keys"]:
            reply.keys.add(**k)
        for w in data["waiting"]:
            reply.waiting.add(**w)
        return reply


def serve(host: str = "0.0.0.0", port: int = TRACKER_PORT, farm_secret: Optional[str] = None,
          eviction_window_s: float = EVICTION_WINDOW_S, unused_lease_s: float = UNUSED_LEASE_S,
          tls_cert: str = "", tls_key: str = "", max_workers: int = MAX_WORKERS):
    """Start a tracker; returns (grpc server, service, bound port).

    ``farm_secret=None`` reads ``$TETHER_FARM_SECRET``; ``tls_cert``/``tls_key``
    (PEM files) switch on TLS.

    >>> server, service, port = serve("127.0.0.1", 0)   # doctest: +SKIP
    """
    if farm_secret is None:
        farm_secret = os.environ.get(FARM_SECRET_ENV, "")
    service = TrackerService(farm_secret=farm_secret, eviction_window_s=eviction_window_s,
                             unused_lease_s=unused_lease_s)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="tracker"),
                         options=CHANNEL_OPTIONS)
    add_servicer(server, "Tracker", service)
    try:
        bound = tls.add_port(server, f"{host}:{port}", tls_cert, tls_key)
    except BaseException:
        service.close()
        raise
    server.start()
    return server, service, bound

"""The tracker's shell around the pure scheduler: gRPC for users, links for boards.

One lock guards the scheduler. A ``RequestDevice`` call enqueues a request and
waits on its own event until the scheduler grants a lease, the deadline passes,
or the client goes away (then the request leaves the queue). Boards reach the
``board_*`` methods through their links on the tracker's port
(remote/tracker/boards.py).
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent import futures
from typing import TYPE_CHECKING, Dict, List, Optional, Set

import grpc

from remote import errors
from remote.defaults import FARM_SECRET_ENV, TOKEN_ENV, TRACKER_PORT
from remote.client.grpc_layer import SERVER_OPTIONS, abort, add_servicer
from remote.errors import AuthenticationError, DeviceBusy, NoSuchKey, RequestTimeout
from remote.proto import pb
from remote.tls import server_context
from remote.tracker.boards import CountBySource, FrontDoor
from remote.tracker.farmlog import FarmLog
from remote.tracker.scheduler import LeaseRefused, Request, Scheduler
from remote.tracker.tokens import TokenBook

if TYPE_CHECKING:  # SQLAlchemy is imported only by a tracker that keeps a database
    from remote.tracker.farmdb import FarmDatabase

log = logging.getLogger("tether.tracker")

# A board pings every second; one silent for the window is dropped.
EVICTION_WINDOW_S = 2.5
# A granted board the client has not opened a session on within this is given
# back: a client opens its session at once, and an unused grant holds a board.
UNUSED_LEASE_S = 10.0
# How often the tracker's port loop marks itself as caught up (FrontDoor.last_tick).
LOOP_TICK_S = 0.1
# Requests waiting for a device, at most, in all, per client name and per
# address they come from (a caller without a token chooses its name).
MAX_WAITING = 512
MAX_WAITING_PER_CLIENT = 64
MAX_WAITING_PER_SOURCE = 128
# An address whose granted boards went unused this many times within the
# window is refused leases until the oldest of them leaves it: a grant holds
# a board for the unused-lease timeout, and one caller asking again and again
# without opening sessions would keep the board from everyone else.
MAX_UNUSED_GRANTS = 3
UNUSED_GRANTS_WINDOW_S = 60.0
# Lease tokens remembered after their lease ended, for a session's status and close.
RECENT_LEASES = 4096
# Each waiting RequestDevice call holds one worker thread, so the pool is large;
# threads are only started as calls arrive.
MAX_WORKERS = 1024


def printable(name: str, limit: int = 200) -> str:
    """A name a client gave, as the summary may show it: control characters
    (a terminal's escape sequences among them) escaped, and not too long."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)
    return text[:limit]


def _digest(credential: str) -> str:
    """The end of a board's device id: 64 bits of its credential's SHA-256."""
    return hashlib.sha256(credential.encode()).hexdigest()[:16]


def heartbeat_interval(eviction_window_s: float) -> float:
    """Ping often enough that a live device misses two before eviction, and no
    more often than once a second (ten thousand boards ping a tracker)."""
    return max(0.05, min(1.0, eviction_window_s / 2.5))


class _Waiter:
    def __init__(self):
        self.event = threading.Event()
        self.lease = None


class TrackerService:
    """Implements the tether.v1.Tracker service."""

    def __init__(self, farm_secret: str = "", eviction_window_s: float = EVICTION_WINDOW_S,
                 unused_lease_s: float = UNUSED_LEASE_S, clock=time.monotonic,
                 tokens: Optional[TokenBook] = None, db: Optional["FarmDatabase"] = None):
        self._clock = clock
        self.db = db           # the farm database (None: --db none); writes off the lease path
        self._tokens = tokens  # set: users need a token (--require-tokens)
        self.log = FarmLog()   # recent events and the counts /metrics shows
        self._lock = threading.Lock()
        self._scheduler = Scheduler(new_token=lambda: secrets.token_urlsafe(24),
                                    unused_lease_s=unused_lease_s)
        self._infos: Dict[str, object] = {}       # device_id -> pb.DeviceInfo
        self._waiters: Dict[str, _Waiter] = {}    # request_id -> waiter
        # Requests waiting, by client name and by the address they came from.
        self._waiting_by = CountBySource(MAX_WAITING_PER_CLIENT, MAX_WAITING)
        self._waiting_from = CountBySource(MAX_WAITING_PER_SOURCE, MAX_WAITING)
        self._ids = itertools.count(1)
        self._farm_secret = farm_secret
        self._relayed: Set[str] = set()           # devices reached through the relay
        self._credentials: Dict[str, str] = {}    # device_id -> the board's credential
        # Tokens of recent leases -> their device: a client asks a relayed board
        # about its session (status, close) with its lease's token, also after
        # the lease ended; the oldest are forgotten first.
        self._granted: "OrderedDict[str, str]" = OrderedDict()
        self._granted_to: "OrderedDict[str, str]" = OrderedDict()  # token -> caller's address
        self._unused_from: Dict[str, List[float]] = {}  # address -> when its grants expired
        self.door: Optional[FrontDoor] = None
        self.eviction_window_s = eviction_window_s
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="tracker-reaper", daemon=True)
        self._reaper.start()

    def close(self):
        self._stop.set()
        if self.db is not None:
            self.db.close()

    # ---------------------------------------------------------- plumbing --
    def check_secret(self, given: str) -> None:
        if self._farm_secret and not hmac.compare_digest(given.encode(), self._farm_secret.encode()):
            raise AuthenticationError(
                f"wrong or missing farm secret; pass --farm-secret or set {FARM_SECRET_ENV}")

    def _check_secret(self, context, given: str):
        try:
            self.check_secret(given)
        except AuthenticationError as exc:
            abort(context, exc)

    def _user(self, context, request) -> Optional[str]:
        """Who calls: with --require-tokens the name of the caller's token
        (anything else is refused), otherwise None after the farm secret check."""
        if self._tokens is None:
            self._check_secret(context, request.farm_secret)
            return None
        try:
            name = self._tokens.name_of(request.user_token)
        except ValueError as exc:
            log.error("%s", exc)
            name = None
        if name is None:
            abort(context, AuthenticationError(
                "this tracker requires a user token: ask its admin for one "
                f"(tether token add NAME) and set {TOKEN_ENV}"
                + (" (the one given is not known)" if request.user_token else "")))
        return name

    def _dispatch_locked(self):
        now = self._clock()
        for request, lease in self._scheduler.assign(now):
            waiter = self._waiters.pop(request.request_id, None)
            if waiter is None:  # the requester left between enqueue and grant
                self._scheduler.release(lease.token, now)
                continue
            self.log.granted(request.key, now - request.enqueued_at)
            waiter.lease = lease
            waiter.event.set()

    def _recent_unused_locked(self, source: str, now: float) -> List[float]:
        """When grants to ``source`` expired unused within the window, oldest first."""
        times = [t for t in self._unused_from.get(source, ()) if now - t < UNUSED_GRANTS_WINDOW_S]
        if times:
            self._unused_from[source] = times
        else:
            self._unused_from.pop(source, None)
        return times

    def _release_locked(self, token: str, how: str) -> None:
        """End a lease (recording how long it was held) and serve the queue."""
        lease = self._scheduler.leases.get(token)
        device = self._scheduler.release(token, self._clock())
        if lease is not None and device is not None:
            held_s = self._clock() - lease.granted_at
            self.log.ended(device.key, lease.device_id, lease.client, held_s, how)
            if self.db is not None:
                self.db.record_session(device.key, lease.device_id, lease.client, held_s, how)
        self._dispatch_locked()

    def _judged_now(self) -> float:
        """The time up to which boards' silence can be judged: the last moment
        the tracker's port was read. A loop that is behind (a burst of work)
        has pings waiting in its sockets; their boards are not silent."""
        now = self._clock()
        if self.door is None:
            return now
        return min(now, self.door.last_tick + LOOP_TICK_S)

    def _reap_loop(self):
        while not self._stop.wait(min(0.25, self.eviction_window_s / 4)):
            now = self._judged_now()
            # Found without the lock (ten thousand boards take a while to look
            # at), evicted under it once it is known there are any.
            silent = any(now - d.last_seen > self.eviction_window_s
                         for d in list(self._scheduler.devices.values()))
            with self._lock:
                now = self._judged_now()
                evicted = (self._scheduler.evict_silent(now, self.eviction_window_s)
                           if silent else [])
                for device in evicted:
                    log.warning("evicted %s (%s at %s): silent for %.1f s",
                                device.device_id, device.key, device.address or "relay",
                                now - device.last_seen)
                    self.log.evicted(device.key, device.device_id,
                                     f"silent for {now - device.last_seen:.1f} s")
                    self._infos.pop(device.device_id, None)
                    self._relayed.discard(device.device_id)
                for lease in self._scheduler.expire_unused(now):
                    log.info("lease on %s expired unused", lease.device_id)
                    source = self._granted_to.pop(lease.token, "")
                    if source:
                        self._unused_from.setdefault(source, []).append(now)
                for source in list(self._unused_from):
                    self._recent_unused_locked(source, now)
                    self.log.event("expired", f"lease on {lease.device_id} for {lease.client} "
                                              "expired unused")
                self._dispatch_locked()
            if self.door is not None:
                for device in evicted:
                    self.door.call(self.door.evicted, device.device_id)

    # ------------------------------------------------------- board links --
    def board_register(self, frame, relayed: bool):
        """A board's link registered it (again); returns (device id, its credential,
        ping interval).

        A new board gets an id and a credential of its own; registering again
        under that id (after a broken link, a tracker restart) needs the
        credential, so knowing a board's id (Summary shows it) is not enough to
        take its place. The id ends with a digest of the credential, so a
        tracker that restarted, and knows no credential, still tells the board
        the id was made for from anyone else who registers first under it.
        """
        self.check_secret(frame.farm_secret)
        if not frame.key:
            raise errors.InvalidArgument("registration needs a key")
        with self._lock:
            device_id = frame.device_id
            if device_id:
                known = self._credentials.get(device_id)
                if known is not None:
                    owner = hmac.compare_digest(known.encode(), frame.token.encode())
                else:
                    owner = bool(frame.token) and hmac.compare_digest(
                        device_id.rsplit("-", 1)[-1].encode(), _digest(frame.token).encode())
                if not owner:
                    raise AuthenticationError(
                        f"device id {device_id} belongs to another board: a board registers "
                        "again only with the credential the tracker gave it; register "
                        "without a device id to join as a new board")
                credential = frame.token
            else:
                credential = secrets.token_urlsafe(24)
                device_id = f"{frame.key}-{next(self._ids)}-{_digest(credential)}"
            self._credentials[device_id] = credential
            self._scheduler.register(device_id, frame.key, frame.address,
                                     dict(frame.info.attributes), self._clock(),
                                     live_tokens=list(frame.live_tokens))
            self._infos[device_id] = frame.info
            if relayed:
                self._relayed.add(device_id)
            else:
                self._relayed.discard(device_id)
            self._dispatch_locked()
        log.info("registered %s (%s %s)", device_id, frame.key,
                 "through the relay" if relayed else f"at {frame.address}")
        self.log.event("registered", f"{device_id} ({frame.key}) "
                       + ("through the relay" if relayed else f"at {frame.address}"))
        return device_id, credential, heartbeat_interval(self.eviction_window_s)

    def board_count(self) -> int:
        return len(self._scheduler.devices)

    def board_seen(self, device_id: str) -> None:
        # One attribute store, atomic in Python: no lock for the most frequent call.
        device = self._scheduler.devices.get(device_id)
        if device is not None:
            device.last_seen = self._clock()

    def board_redeem(self, device_id: str, token: str) -> None:
        with self._lock:
            try:
                self._scheduler.redeem(device_id, token, self._clock())
            except LeaseRefused as exc:
                raise AuthenticationError(str(exc)) from None

    def board_release(self, device_id: str, token: str) -> None:
        """A board ended a session: only its own leases are its to end."""
        with self._lock:
            lease = self._scheduler.leases.get(token)
            if lease is not None and lease.device_id != device_id:
                raise AuthenticationError(f"that lease is not for device {device_id}")
            self._release_locked(token, "session ended on the board")

    def board_gone(self, device_id: str, why: str) -> None:
        with self._lock:
            device = self._scheduler.remove(device_id)
            self._infos.pop(device_id, None)
            self._relayed.discard(device_id)
            self._dispatch_locked()
        if device is not None:
            log.warning("dropped %s (%s): %s", device_id, device.key, why)
            self.log.evicted(device.key, device_id, why)

    def relay_target(self, token: str) -> str:
        """The device a lease token is for, for a client reaching it through the relay."""
        with self._lock:
            lease = self._scheduler.leases.get(token)
        if lease is None:
            raise AuthenticationError("unknown or expired lease token; request a device again")
        return lease.device_id

    def check_session_token(self, device_id: str, token: str) -> None:
        """A client's status or close for a session on a relayed board names the
        token of the lease the session was opened with (live or recent): the
        relay carries nothing for whoever only knows a device id."""
        with self._lock:
            lease = self._scheduler.leases.get(token)
            granted = lease.device_id if lease is not None else self._granted.get(token)
        if not token or granted != device_id:
            raise AuthenticationError(
                f"asking device {device_id or '(none)'} about a session through the tracker "
                "needs the token of the lease it was opened with")

    # -------------------------------------------------------------- RPCs --
    def _v1_board(self, context):
        context.abort(grpc.StatusCode.PERMISSION_DENIED,
                      "this tracker speaks Tether board protocol v2 and this board protocol v1 "
                      "(gRPC): update Tether on the board (tether bootstrap, or install the "
                      "same version as the tracker)")

    def Register(self, request, context):
        self._v1_board(context)

    def Heartbeat(self, request, context):
        self._v1_board(context)

    def RedeemLease(self, request, context):
        self._v1_board(context)

    def RequestDevice(self, request, context):
        user = self._user(context, request)
        request_id = f"r{next(self._ids)}"
        waiter = _Waiter()
        client = user or printable(request.client or context.peer())
        with self._lock:
            if not self._scheduler.serves(request.key) and not request.wait_for_key:
                served = self._scheduler.served_keys()
                abort(context, NoSuchKey(
                    f"no device registered under key {request.key!r}; registered keys: "
                    f"{', '.join(served) if served else '(none)'}"))
            # Each waiting request holds one of the server's threads: bounded,
            # so that requests parked by one client cannot starve the others.
            if self._waiting_by.total >= MAX_WAITING:
                abort(context, DeviceBusy(
                    f"{self._waiting_by.total} requests are already waiting at this tracker, "
                    f"its limit; try again later"))
            source = self.door.source_of(context.peer()) if self.door else context.peer()
            unused = self._recent_unused_locked(source, self._clock())
            if len(unused) >= MAX_UNUSED_GRANTS:
                wait_s = unused[0] + UNUSED_GRANTS_WINDOW_S - self._clock()
                abort(context, DeviceBusy(
                    f"{len(unused)} boards granted to {source} in the last "
                    f"{UNUSED_GRANTS_WINDOW_S:g} s went unused (a granted board waits "
                    f"{self._scheduler.unused_lease_s:g} s for its session, kept from everyone "
                    f"else): open a session on each board you are granted; request again in "
                    f"{max(wait_s, 0.0):.0f} s"))
            if not self._waiting_by.add(client):
                abort(context, DeviceBusy(
                    f"{client} already has {self._waiting_by.of(client)} requests waiting, the "
                    "most one client may have; wait for those (or cancel them) first"))
            if not self._waiting_from.add(source):
                self._waiting_by.remove(client)
                abort(context, DeviceBusy(
                    f"{source} already has {self._waiting_from.of(source)} requests waiting, "
                    "the most one address may have, whatever names they give; wait for those "
                    "(or cancel them) first"))
            self._waiters[request_id] = waiter
            self._scheduler.enqueue(Request(request_id, request.key, request.priority,
                                            client, self._clock(),
                                            dict(request.filters)))
            self._dispatch_locked()
        # The client went away: stop waiting. add_callback returns False when the
        # call has already ended, and then the callback would never run.
        if not context.add_callback(waiter.event.set):
            waiter.event.set()
        timeout = request.timeout_s if request.timeout_s > 0 else None
        waiter.event.wait(timeout)
        with self._lock:
            self._waiting_by.remove(client)
            self._waiting_from.remove(source)
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
            relayed = lease.device_id in self._relayed
            self._granted[lease.token] = lease.device_id
            self._granted_to[lease.token] = source
            for recent in (self._granted, self._granted_to):
                while len(recent) > RECENT_LEASES:
                    recent.popitem(last=False)
            reply = pb.Lease(token=lease.token, device_id=lease.device_id, key=device.key,
                             address="" if relayed else device.address, relayed=relayed)
            if lease.device_id in self._infos:
                reply.info.CopyFrom(self._infos[lease.device_id])
        return reply

    def ReleaseLease(self, request, context):
        user = self._user(context, request)
        with self._lock:
            lease = self._scheduler.leases.get(request.token)
            if user is not None and lease is not None and lease.client != user:
                abort(context, AuthenticationError(
                    f"that lease is held by {lease.client}, not by {user}: only its holder "
                    "(or its board) gives it back"))
            self._release_locked(request.token, "given back by the client")
        return pb.Empty()

    def Summary(self, request, context):
        if self._tokens is not None:
            self._user(context, request)
        return self.summary_reply()

    def _database(self, context) -> "FarmDatabase":
        if self.db is None:
            abort(context, errors.InvalidArgument(
                "this tracker keeps no farm database (started with --db none); start it "
                "with --db sqlite:///PATH or --db postgresql://... to record results"))
        return self.db

    def RecordResult(self, request, context):
        user = self._user(context, request)
        db = self._database(context)
        try:
            report = json.loads(request.report_json)
            ids = db.record(request.kind, report, dict(request.labels),
                            user or printable(request.client or context.peer()))
        except json.JSONDecodeError as exc:
            abort(context, errors.InvalidArgument(f"the report is not JSON: {exc}"))
        except errors.InvalidArgument as exc:
            abort(context, exc)
        except Exception as exc:  # noqa: BLE001 - the database's own trouble, said as such
            abort(context, errors.RemoteError(
                f"the farm database {db.shown} did not take the report: {exc}"))
        return pb.RecordReply(record_ids=ids, database=db.shown)

    def QueryResults(self, request, context):
        self._user(context, request)
        db = self._database(context)
        try:
            rows = db.records(request.kind, request.model, request.key, dict(request.labels),
                              request.limit)
        except errors.InvalidArgument as exc:
            abort(context, exc)
        except Exception as exc:  # noqa: BLE001 - the database's own trouble, said as such
            abort(context, errors.RemoteError(f"the farm database {db.shown} could not be "
                                              f"read: {exc}"))
        return pb.ResultsReply(records_json=json.dumps(rows), database=db.shown)

    def summary_reply(self):
        """The pool as the Summary call answers it (no check of who asks)."""
        with self._lock:
            data = self._scheduler.summary(self._clock())
            infos = dict(self._infos)
        reply = pb.TrackerSummary()
        for d in data["devices"]:
            status = reply.devices.add(relayed=d["device_id"] in self._relayed, **d)
            if d["device_id"] in infos:
                status.info.CopyFrom(infos[d["device_id"]])
        for k in data["keys"]:
            reply.keys.add(**k)
        for w in data["waiting"]:
            reply.waiting.add(**w)
        return reply


class RunningTracker:
    """A started tracker: its port, the service, and ``stop()``."""

    def __init__(self, grpc_server, service: TrackerService, door: FrontDoor, folder: str):
        self.grpc_server = grpc_server
        self.service = service
        self.door = door
        self.port = door.port
        self._folder = folder

    def stop(self, grace: float = 1.0):
        self.door.close()
        self.service.close()
        self.grpc_server.stop(grace)
        shutil.rmtree(self._folder, ignore_errors=True)


def serve(host: str = "0.0.0.0", port: int = TRACKER_PORT, farm_secret: Optional[str] = None,
          eviction_window_s: float = EVICTION_WINDOW_S, unused_lease_s: float = UNUSED_LEASE_S,
          tls_cert: str = "", tls_key: str = "", max_workers: int = MAX_WORKERS,
          tokens_file: Optional[str] = None, db_url: Optional[str] = None) -> RunningTracker:
    """Start a tracker on one port: gRPC for users and tools, frames for boards.

    ``farm_secret=None`` reads ``$TETHER_FARM_SECRET``; ``tls_cert``/``tls_key``
    (PEM files) switch on TLS for everything on the port; ``tokens_file`` makes
    users' requests, releases and summaries need a token from that file;
    ``db_url`` (SQLAlchemy URL: ``sqlite:///PATH``, ``postgresql://...``)
    keeps every session, benchmark and accuracy check in that database.

    >>> tracker = serve("127.0.0.1", 0)   # doctest: +SKIP
    """
    if farm_secret is None:
        farm_secret = os.environ.get(FARM_SECRET_ENV, "")
    context = server_context(tls_cert, tls_key)
    if db_url:
        from remote.tracker.farmdb import FarmDatabase
        db = FarmDatabase(db_url)
    else:
        db = None
    service = TrackerService(farm_secret=farm_secret, eviction_window_s=eviction_window_s,
                             unused_lease_s=unused_lease_s,
                             tokens=None if tokens_file is None else TokenBook(tokens_file),
                             db=db)
    # The gRPC server listens on a Unix socket in a folder only this user can
    # enter; the port's front door carries gRPC connections to it.
    folder = tempfile.mkdtemp(prefix="tether-tracker-")
    grpc_path = os.path.join(folder, "grpc.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                    thread_name_prefix="tracker"),
                         options=SERVER_OPTIONS)
    add_servicer(server, "Tracker", service)
    try:
        if not server.add_insecure_port("unix:" + grpc_path):
            raise OSError(f"cannot listen on the Unix socket {grpc_path}")
        server.start()
        door = FrontDoor(service, host, port, grpc_path, context)
    except BaseException:
        service.close()
        server.stop(0)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    service.door = door
    return RunningTracker(server, service, door, folder)

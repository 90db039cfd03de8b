"""The client's view of a tracker: request devices, read the pool's state."""
from __future__ import annotations

import getpass
import os
import socket
import time
from dataclasses import dataclass
from typing import Dict, Optional

import grpc

from remote import errors, tls
from remote.client import display
from remote.defaults import FARM_SECRET_ENV, TLS_CA_ENV, TOKEN_ENV, TRACKER_ENV
from remote.client.session import Session, device_info_dict
from remote.client.grpc_layer import from_rpc_error, make_stub, open_channel
from remote.proto import pb


def default_client_name() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name in some containers
        user = "user"
    return f"{user}@{socket.gethostname()}:{os.getpid()}"


@dataclass
class Lease:
    """A device granted by the tracker: where it is, and the one-time token it wants."""

    token: str
    device_id: str
    address: str
    key: str
    #: reached through the tracker (``address`` is then the tracker's)
    relayed: bool = False


class TrackerClient:
    """A connection to a tracker.

    >>> tracker = rpc.connect_tracker("farm.local", 9190)     # doctest: +SKIP
    >>> with tracker.request("rasp4b64", timeout=30) as sess:  # doctest: +SKIP
    ...     print(sess.device_info()["cpu_model"])
    """

    def __init__(self, host: str, port: int, farm_secret: Optional[str] = None,
                 timeout: Optional[float] = 10.0, tls_ca: Optional[str] = None,
                 token: Optional[str] = None):
        self.address = f"{host}:{port}"
        self.timeout = timeout
        self.farm_secret = (os.environ.get(FARM_SECRET_ENV, "")
                            if farm_secret is None else farm_secret)
        self.tls_ca = tls.default_ca(tls_ca)
        # A user token, for trackers that require one (default $TETHER_TOKEN).
        self.token = os.environ.get(TOKEN_ENV, "") if token is None else token
        self._channel = open_channel(self.address, self.tls_ca)
        self._stub = make_stub(self._channel, "Tracker")

    def _call(self, method, request, timeout):
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc, f"tracker {self.address}")
        if isinstance(error, errors.ConnectionFailed) and "refused" in str(error).lower():
            # Nothing listens there: TLS cannot be the cause, so no TLS hint.
            error = type(error)(f"{error} Start one with `tether tracker`, or name the farm's "
                                f"with --tracker HOST:PORT or ${TRACKER_ENV}.")
        elif isinstance(error, errors.ConnectionFailed):
            # A TLS/plaintext mismatch shows up only as a dropped connection.
            hint = ("if the tracker serves TLS, give the certificate to trust: --tls-ca FILE on "
                    f"the command line, tls_ca= in Python, or {TLS_CA_ENV}"
                    if not self.tls_ca else
                    f"is the tracker serving TLS with a certificate {self.tls_ca!r} trusts?")
            error = type(error)(f"{error}; {hint}")
        raise error

    def lease(self, key: str, priority: int = 0, timeout: Optional[float] = None,
              wait_for_key: bool = False, filters: Optional[Dict[str, str]] = None,
              client: Optional[str] = None) -> Lease:
        """Wait for a device of ``key`` and return its lease, without opening a session.

        ``request`` is this plus ``Session``; use this to hand the token to
        another process, or ``release(lease)`` to give the device back unused.
        """
        request = pb.DeviceRequest(key=key, priority=priority, timeout_s=timeout or 0.0,
                                   wait_for_key=wait_for_key, filters=filters or {},
                                   client=client or default_client_name(),
                                   farm_secret=self.farm_secret, user_token=self.token)
        # The tracker enforces the timeout; the deadline here only covers a lost tracker.
        deadline = None if timeout is None else timeout + 10.0
        call = self._stub.RequestDevice.future(request, timeout=deadline)
        try:
            reply = self._call(lambda _request, timeout: call.result(), request, None)
        except BaseException:
            # Ctrl-C (or closing this client) while waiting: cancelling the call takes
            # the request out of the tracker's queue; a lease granted in that instant
            # goes straight back.
            if not call.cancel():
                self._give_back_granted(call)
            raise
        if not reply.token:
            raise errors.ConnectionFailed(f"the request to tracker {self.address} was "
                                          "cancelled before a device was granted")
        return self._lease(reply)

    def _lease(self, reply) -> Lease:
        if reply.relayed:
            return Lease(reply.token, reply.device_id, self.address, reply.key, relayed=True)
        return Lease(reply.token, reply.device_id, reply.address, reply.key)

    def _give_back_granted(self, call) -> None:
        try:
            reply = call.result(timeout=0)
            if reply.token:
                self.release(self._lease(reply))
        except BaseException:  # noqa: BLE001 - the tracker expires what is left
            pass

    def release(self, lease: Lease) -> None:
        """Give a leased device back (a no-op when the lease has already ended)."""
        self._call(self._stub.ReleaseLease, pb.ReleaseRequest(
            token=lease.token, farm_secret=self.farm_secret, user_token=self.token), self.timeout)

    def request(self, key: str, priority: int = 0, timeout: Optional[float] = None,
                session_timeout: float = 0.0, wait_for_key: bool = False,
                filters: Optional[Dict[str, str]] = None,
                client: Optional[str] = None,
                call_timeout: Optional[float] = 30.0) -> Session:
        """Lease a device of ``key`` and open a session on it.

        Blocks until a device is free (``timeout`` seconds at most; ``None``
        waits without limit) and raises ``RequestTimeout`` past it. A key no
        device serves raises ``NoSuchKey`` at once unless ``wait_for_key``.
        ``call_timeout`` is how long any one call in the session (opening it
        included) may take on the board; give slow boards more.

        >>> with tracker.request("qemu-arm64", call_timeout=300) as sess:   # doctest: +SKIP
        ...     sess.upload("net.so")
        """
        client = client or default_client_name()
        lease = self.lease(key, priority=priority, timeout=timeout, wait_for_key=wait_for_key,
                           filters=filters, client=client)

        def give_back():
            try:
                self.release(lease)
            except errors.TetherError:
                pass  # the device server releases it too, and the tracker expires it

        return Session(lease.address, lease_token=lease.token, session_timeout=session_timeout,
                       client=client, timeout=call_timeout, on_close=give_back,
                       tls_ca=self.tls_ca, device_id=lease.device_id, relayed=lease.relayed)

    def summary(self) -> dict:
        """Devices, per-key counts and waiting requests, as plain data (JSON-ready).

        Each device has key, address, state (free/leased/in_use), holder and
        ``held_since`` (Unix time) and its capabilities; each waiting request
        its key, priority, client and seconds waited, in the order they will be served.
        """
        reply = self._call(self._stub.Summary, pb.SummaryRequest(user_token=self.token),
                           self.timeout)
        now = time.time()
        devices = []
        for d in reply.devices:
            devices.append({
                "device_id": d.device_id, "key": d.key, "address": d.address, "state": d.state,
                "holder": d.holder, "held_s": d.held_s, "relayed": d.relayed,
                "held_since": now - d.held_s if d.holder else None,
                "last_seen_s": d.last_seen_s,
                **device_info_dict(d.info),
            })
        keys = [{"key": k.key, "total": k.total, "free": k.free, "pending": k.pending}
                for k in reply.keys]
        waiting = [{"key": w.key, "priority": w.priority, "client": w.client,
                    "waited_s": w.waited_s} for w in reply.waiting]
        return display.PoolSummary(tracker=self.address, devices=devices, keys=keys, waiting=waiting)

    def text_summary(self) -> str:
        """The pool as a table a person reads (what ``tether status`` prints)."""
        return display.summary_text(self.summary())

    def close(self):
        self._channel.close()

    def __repr__(self) -> str:
        return f"<TrackerClient {self.address}>"

    def _repr_html_(self) -> str:
        try:
            return display.summary_html(self.summary())
        except errors.TetherError as exc:
            return display.error_html(f"tracker {self.address}: {exc}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


"""The client's view of a tracker: request devices, read the pool's state."""
from __future__ import annotations

import getpass
import os
import socket
from typing import Dict, Optional

import grpc

from remote import errors
from remote.client.session import Session
from remote.proto import CHANNEL_OPTIONS, make_stub, pb


def default_client_name() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name in some containers
        user = "user"
    return f"{user}@{socket.gethostname()}:{os.getpid()}"


class TrackerClient:
    """A connection to a tracker.

    >>> tracker = rpc.connect_tracker("farm.local", 9190)     # doctest: +SKIP
    >>> with tracker.request("rasp4b64", timeout=30) as sess:  # doctest: +SKIP
    ...     print(sess.device_info()["cpu_model"])
    """

    def __init__(self, host: str, port: int, farm_secret: Optional[str] = None,
                 timeout: Optional[float] = 10.0):
        self.address = f"{host}:{port}"
        self.timeout = timeout
        self.farm_secret = (os.environ.get("TETHER_FARM_SECRET", "")
                            if farm_secret is None else farm_secret)
        self._channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self._stub = make_stub(self._channel, "Tracker")

    def _call(self, method, request, timeout):
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc, f"tracker {self.address}") from None

    def request(self, key: str, priority: int = 0, timeout: Optional[float] = None,
                session_timeout: float = 0.0, wait_for_key: bool = False,
                filters: Optional[Dict[str, str]] = None,
                client: Optional[str] = None) -> Session:
        """Lease a device of ``key`` and open a session on it.

        Blocks until a device is free (``timeout`` seconds at most; ``None``
        waits without limit) and raises ``RequestTimeout`` past it. A key no
        device serves raises ``NoSuchKey`` at once unless ``wait_for_key``.
        """
        client = client or default_client_name()
        request = pb.DeviceRequest(key=key, priority=priority, timeout_s=timeout or 0.0,
                                   wait_for_key=wait_for_key, filters=filters or {},
                                   client=client, farm_secret=self.farm_secret)
        # The tracker enforces the timeout; the deadline here only covers a lost tracker.
        deadline = None if timeout is None else timeout + 10.0
        lease = self._call(self._stub.RequestDevice, request, deadline)

        def give_back():
            try:
                self._stub.ReleaseLease(pb.ReleaseRequest(token=lease.token,
                                                          farm_secret=self.farm_secret),
                                        timeout=5.0)
            except grpc.RpcError:
                pass  # the tracker expires the lease by itself

        return Session(lease.address, lease_token=lease.token, session_timeout=session_timeout,
                       client=client, on_close=give_back)

    def summary(self) -> dict:
        """Devices, per-key counts and waiting requests, as plain data."""
        reply = self._call(self._stub.Summary, pb.Empty(), self.timeout)
        devices = []
        for d in reply.devices:
            devices.append({
                "device_id": d.device_id, "key": d.key, "address": d.address, "state": d.state,
                "holder": d.holder, "held_s": d.held_s, "last_seen_s": d.last_seen_s,
                "triple": d.info.triple, "cpu_model": d.info.cpu_model, "cores": d.info.cores,
                "memory_bytes": d.info.memory_bytes, "os": d.info.os,
                "attributes": dict(d.info.attributes),
            })
        keys = [{"key": k.key, "total": k.total, "free": k.free, "pending": k.pending}
                for k in reply.keys]
        waiting = [{"key": w.key, "priority": w.priority, "client": w.client,
                    "waited_s": w.waited_s} for w in reply.waiting]
        return {"tracker": self.address, "devices": devices, "keys": keys, "waiting": waiting}

    def text_summary(self) -> str:
        """The pool as a table a person reads (what ``tether status`` prints)."""
        return format_summary(self.summary())

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _table(headers, rows) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()
             for r in [headers, *rows]]
    return "\n".join(lines)


def format_summary(data: dict) -> str:
    """Render ``TrackerClient.summary()`` data as text tables."""
    out = [f"tracker {data['tracker']}", ""]
    if data["keys"]:
        out.append(_table(("KEY", "TOTAL", "FREE", "PENDING"),
                          [(k["key"], k["total"], k["free"], k["pending"]) for k in data["keys"]]))
    else:
        out.append("no devices registered")
    if data["devices"]:
        out += ["", _table(
            ("DEVICE", "KEY", "ADDRESS", "STATE", "HOLDER", "TRIPLE", "CORES", "OS"),
            [(d["device_id"], d["key"], d["address"], d["state"],
              f"{d['holder']} ({d['held_s']:.0f}s)" if d["holder"] else "-",
              d["triple"], d["cores"], d["os"]) for d in data["devices"]])]
    if data["waiting"]:
        out += ["", _table(("WAITING FOR", "PRIORITY", "CLIENT", "WAITED"),
                           [(w["key"], w["priority"], w["client"], f"{w['waited_s']:.1f}s")
                            for w in data["waiting"]])]
    return "\n".join(out)

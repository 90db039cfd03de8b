"""The device server's link to its tracker: registration, heartbeats, leases.

The link re-registers by itself when the tracker restarts (a heartbeat answers
``known=False`` or fails), backing off from 0.5 s up to 10 s between tries.
"""
from __future__ import annotations

import logging
import socket
import threading

import grpc

from remote import errors
from remote.proto import CHANNEL_OPTIONS, make_stub, pb

log = logging.getLogger("tether.server")

RPC_TIMEOUT_S = 5.0


def local_address_towards(host: str, port: int) -> str:
    """The local IP this machine would use to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class TrackerLink:
    """Keeps one device registered with a tracker for the life of the server."""

    def __init__(self, tracker: str, key: str, address: str, info, farm_secret: str = ""):
        self.tracker = tracker
        self.key = key
        self.address = address
        self.info = info
        self.farm_secret = farm_secret
        self.device_id = ""
        self.registered = threading.Event()
        self._channel = grpc.insecure_channel(tracker, options=CHANNEL_OPTIONS)
        self._stub = make_stub(self._channel, "Tracker")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tracker-link", daemon=True)

    def start(self):
        self._thread.start()

    def close(self):
        self._stop.set()
        self._channel.close()

    def _register(self) -> float:
        reply = self._stub.Register(pb.RegisterRequest(
            key=self.key, address=self.address, info=self.info,
            device_id=self.device_id, farm_secret=self.farm_secret), timeout=RPC_TIMEOUT_S)
        if not self.device_id:
            log.info("registered with tracker %s as %s (key %s, address %s)",
                     self.tracker, reply.device_id, self.key, self.address)
        else:
            log.info("registered again with tracker %s as %s", self.tracker, reply.device_id)
        self.device_id = reply.device_id
        self.registered.set()
        return reply.heartbeat_interval_s or 1.0

    def _run(self):
        backoff = 0.5
        interval = 0.0
        while not self._stop.is_set():
            try:
                if not self.registered.is_set():
                    interval = self._register()
                elif not self._stub.Heartbeat(pb.HeartbeatRequest(
                        device_id=self.device_id, farm_secret=self.farm_secret),
                        timeout=RPC_TIMEOUT_S).known:
                    self.registered.clear()
                    continue
                backoff = 0.5
                self._stop.wait(interval)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                    log.error("tracker %s refused us: %s", self.tracker, exc.details())
                else:
                    log.warning("tracker %s unreachable (%s); retrying in %.1f s",
                                self.tracker, exc.code().name, backoff)
                self.registered.clear()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def redeem(self, token: str) -> None:
        """Ask the tracker whether ``token`` is a live lease on this device."""
        try:
            self._stub.RedeemLease(pb.RedeemRequest(
                device_id=self.device_id, token=token, farm_secret=self.farm_secret),
                timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc, f"tracker {self.tracker}")

    def release(self, token: str) -> None:
        self._stub.ReleaseLease(pb.ReleaseRequest(token=token, farm_secret=self.farm_secret),
                                timeout=RPC_TIMEOUT_S)

"""The device server's link to its tracker: registration, heartbeats, leases.

The link re-registers by itself when the tracker restarts (a heartbeat answers
``known=False`` or fails), backing off from 0.5 s up to 10 s between tries.

It also counts, on the device side, the leases it redeemed and whether two of
them were ever live at once; ``close()`` logs the counts (``lease stats: ...``),
which the farm's load test reads back from the server's log.
"""
from __future__ import annotations

import logging
import socket
import threading

import grpc

from remote import errors, tls
from remote.proto import CHANNEL_OPTIONS, make_stub, pb

log = logging.getLogger("tether.server")

RPC_TIMEOUT_S = 5.0
# grpc's own reconnect backoff grows to two minutes; a restarted tracker should
# see its devices again within seconds, so cap it near our own backoff.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


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

    def __init__(self, tracker: str, key: str, address: str, info, farm_secret: str = "",
                 tls_ca: str = ""):
        self.tracker = tracker
        self.key = key
        self.address = address
        self.info = info
        self.farm_secret = farm_secret
        self.device_id = ""
        self.registered = threading.Event()
        self.redeemed = 0          # leases this device accepted
        self.overlaps = 0          # times a lease was redeemed while another was live
        self._live = set()         # tokens redeemed and not yet released
        self._count_lock = threading.Lock()
        self._channel = tls.open_channel(tracker, tls_ca, CHANNEL_OPTIONS + RECONNECT_OPTIONS)
        self._stub = make_stub(self._channel, "Tracker")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tracker-link", daemon=True)

    def start(self):
        self._thread.start()

    def close(self):
        self._stop.set()
        self._channel.close()
        log.info("lease stats: redeemed=%d overlaps=%d", self.redeemed, self.overlaps)

    def _register(self) -> float:
        with self._count_lock:
            live = sorted(self._live)
        reply = self._stub.Register(pb.RegisterRequest(
            key=self.key, address=self.address, info=self.info, device_id=self.device_id,
            farm_secret=self.farm_secret, live_tokens=live), timeout=RPC_TIMEOUT_S)
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
        # The tracker may lease this device while its Register reply is still on
        # the way back, before we know our device id.
        self.registered.wait(RPC_TIMEOUT_S)
        try:
            self._stub.RedeemLease(pb.RedeemRequest(
                device_id=self.device_id, token=token, farm_secret=self.farm_secret),
                timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc, f"tracker {self.tracker}")
        with self._count_lock:
            self.redeemed += 1
            if self._live:
                self.overlaps += 1
                log.error("lease redeemed while %d other(s) were live", len(self._live))
            self._live.add(token)

    def release(self, token: str) -> None:
        """Give the device back to the pool; called once the session has ended."""
        with self._count_lock:
            self._live.discard(token)
        self._stub.ReleaseLease(pb.ReleaseRequest(token=token, farm_secret=self.farm_secret),
                                timeout=RPC_TIMEOUT_S)

"""The device server's link to its tracker (board protocol v2, docs/protocol.md).

The board dials the tracker's port and keeps that one connection open:
``register`` (key, address, capabilities, the lease tokens of sessions still
open), then ``ping`` at the interval the tracker asks for, ``redeem`` when a
client presents a lease token and ``release`` when its session ends. The
tracker sends ``relay`` when a client reaches this board through it; the
board then dials the tracker once more and serves that connection as if the
client had connected directly.

The link dials again by itself when the connection breaks (a tracker restart,
a network fault), backing off from 0.2 s up to 5 s, and registers again under
the same device id with its live tokens.

It also counts, on the device side, the leases it redeemed and whether two of
them were ever live at once; ``close()`` logs the counts (``lease stats: ...``),
which the farm's load test reads back from the server's log.
"""
from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from typing import Callable, Dict, Optional

from remote import errors
from remote.address import split_address
from remote.defaults import TRACKER_PORT
from remote.proto import pb
from remote.proto.frames import (PROTOCOL_VERSION, FrameSocket, PeerClosed, looks_like_http2)
from remote.tls import client_context

log = logging.getLogger("tether.server")

CALL_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
MAX_BACKOFF_S = 5.0


def local_address_towards(host: str, port: int) -> str:
    """The local IP this machine would use to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def dial(address: str, ca: str, timeout: float = CONNECT_TIMEOUT_S) -> socket.socket:
    """A connection to the tracker's port, TLS when ``ca`` is given."""
    host, port = split_address(address, TRACKER_PORT)
    sock = socket.create_connection((host, port), timeout=timeout)
    context = client_context(ca)
    if context is not None:
        try:
            sock = context.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
    return sock


class _Call:
    def __init__(self):
        self.done = threading.Event()
        self.reply = None


class TrackerLink:
    """Keeps one device registered with a tracker for the life of the server."""

    def __init__(self, tracker: str, key: str, address: str, info, farm_secret: str = "",
                 tls_ca: str = "", on_relay: Optional[Callable[[socket.socket], None]] = None,
                 live_tokens: Callable[[], list] = list):
        self.tracker = tracker
        self.key = key
        self.address = address
        self.info = info
        self.farm_secret = farm_secret
        self.tls_ca = tls_ca
        self.device_id = ""
        self._credential = ""      # the tracker's proof that this board owns device_id
        self.registered = threading.Event()
        self.last_error = ""
        self.redeemed = 0          # leases this device accepted
        self.overlaps = 0          # times a lease was redeemed while another was live
        self._live = set()         # tokens redeemed and not yet released
        self._count_lock = threading.Lock()
        self._on_relay = on_relay
        self._live_tokens = live_tokens
        self._ids = itertools.count(1)
        self._calls: Dict[int, _Call] = {}
        self._send_lock = threading.Lock()
        self._fs: Optional[FrameSocket] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tracker-link", daemon=True)

    def start(self):
        self._thread.start()

    def close(self):
        self._stop.set()
        fs = self._fs
        if fs is not None:
            fs.close()
        log.info("stopped; lease stats: redeemed=%d overlaps=%d", self.redeemed, self.overlaps)

    # --------------------------------------------------------------- link --
    def _run(self):
        backoff = 0.2
        while not self._stop.is_set():
            try:
                interval = self._connect()
                backoff = 0.2
                self._serve(interval)
            except errors.AuthenticationError as exc:
                self.last_error = str(exc)
                log.error("tracker %s refused this board: %s", self.tracker, exc)
                backoff = MAX_BACKOFF_S
                if self.device_id:
                    # Its id is not (or no longer) this board's to take: join as
                    # a new board rather than be refused for good.
                    self.device_id = self._credential = ""
                    backoff = 0.2
            except (OSError, errors.TetherError) as exc:
                if self._stop.is_set():
                    return  # close() shut the link's socket under the read: a stop, not a fault
                self.last_error = _describe(exc, self.tracker)
                log.warning("tracker %s: %s; trying again in %.1f s", self.tracker,
                            self.last_error, backoff)
            finally:
                self.registered.clear()
                fs, self._fs = self._fs, None
                if fs is not None:
                    fs.close()
                self._fail_calls()
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _connect(self) -> float:
        fs = FrameSocket(dial(self.tracker, self.tls_ca))
        self._fs = fs
        with self._count_lock:
            live = sorted(set(self._live) | set(self._live_tokens()))
        fs.sock.settimeout(CALL_TIMEOUT_S)
        fs.send(pb.DataFrame(op="register", version=PROTOCOL_VERSION, key=self.key,
                             address=self.address, info=self.info, device_id=self.device_id,
                             token=self._credential, farm_secret=self.farm_secret,
                             live_tokens=live, relay=not self.address))
        reply = fs.recv_header()
        if reply.op == "error":
            raise _error(reply)
        again = bool(self.device_id)
        self.device_id = reply.name
        self._credential = reply.token
        self.last_error = ""
        how = " through its relay" if not self.address else f", address {self.address}"
        log.info("registered%s with tracker %s as %s (key %s%s)", " again" if again else "",
                 self.tracker, self.device_id, self.key, how)
        self.registered.set()
        return reply.seconds or 1.0

    def _serve(self, interval: float):
        """Read the tracker's frames; ping whenever it has been quiet for ``interval``."""
        fs = self._fs
        fs.sock.settimeout(interval)
        last_heard = time.monotonic()
        while not self._stop.is_set():
            try:
                frame = fs.recv_header()
            except socket.timeout:
                if time.monotonic() - last_heard > 3 * interval + CALL_TIMEOUT_S:
                    raise errors.ConnectionFailed("the tracker stopped answering")
                self._send(pb.DataFrame(op="ping"))
                continue
            last_heard = time.monotonic()
            if frame.op == "relay":
                threading.Thread(target=self._relay, args=(frame.name,), daemon=True,
                                 name="relay").start()
            elif frame.id:
                call = self._calls.pop(frame.id, None)
                if call is not None:
                    call.reply = frame
                    call.done.set()

    def _send(self, frame) -> None:
        fs = self._fs
        if fs is None:
            raise errors.ConnectionFailed(f"not connected to tracker {self.tracker}")
        with self._send_lock:
            fs.send(frame)

    def _fail_calls(self):
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call.done.set()

    def _call(self, frame):
        """Send a request on the link and wait for its answer."""
        if not self.registered.wait(CALL_TIMEOUT_S):
            raise errors.ConnectionFailed(
                f"this board is not registered with tracker {self.tracker} "
                f"({self.last_error or 'connecting'}); try again shortly")
        frame.id = next(self._ids)
        call = self._calls[frame.id] = _Call()
        try:
            self._send(frame)
        except OSError as exc:
            self._calls.pop(frame.id, None)
            raise errors.ConnectionFailed(f"tracker {self.tracker}: {exc}") from None
        if not call.done.wait(CALL_TIMEOUT_S) or call.reply is None:
            self._calls.pop(frame.id, None)
            raise errors.ConnectionFailed(f"tracker {self.tracker} did not answer {frame.op} "
                                          f"within {CALL_TIMEOUT_S:g} s")
        if call.reply.op == "error":
            raise _error(call.reply)
        return call.reply

    def _relay(self, relay_id: str):
        """Dial the tracker for a client it is relaying, and serve that connection."""
        try:
            sock = dial(self.tracker, self.tls_ca)
            FrameSocket(sock).send(pb.DataFrame(op="relay", version=PROTOCOL_VERSION,
                                                name=relay_id, device_id=self.device_id,
                                                farm_secret=self.farm_secret))
        except OSError as exc:
            log.warning("could not connect back to tracker %s for a relayed session: %s",
                        self.tracker, exc)
            return
        sock.settimeout(None)
        self._on_relay(sock)

    # ------------------------------------------------------------- leases --
    def redeem(self, token: str) -> None:
        """Ask the tracker whether ``token`` is a live lease on this device."""
        self._call(pb.DataFrame(op="redeem", token=token))
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
        self._call(pb.DataFrame(op="release", token=token))


def _error(frame) -> errors.TetherError:
    cls = getattr(errors, frame.error, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.TetherError)):
        cls = errors.RemoteError
    return cls(frame.text)


def _describe(exc: BaseException, tracker: str) -> str:
    if looks_like_http2(exc):
        return (f"{tracker} answered in HTTP/2: it is a protocol v1 tracker (gRPC only); "
                "run the same Tether version on the tracker and the boards")
    if isinstance(exc, PeerClosed):
        return "the tracker closed the link"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is the tracker running, and is the address right?)"
    return str(exc) or type(exc).__name__

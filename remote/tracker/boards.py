"""The tracker's port: gRPC for users, board links and the relay for boards.

One port serves everyone, so a farm has one address. The first bytes of a
connection tell who is calling: HTTP/2's preface (``PRI * HTTP/2.0``) is a
gRPC client, carried unchanged to the tracker's gRPC server on a private
Unix socket; anything else must be a frame of board protocol v2
(docs/protocol.md):

- ``register``: a board's link. It stays open; the board pings, redeems and
  releases leases on it, and the tracker sends ``relay`` on it.
- ``open`` or ``status`` from a client whose board is reached through the
  tracker: the tracker asks the board (``relay``) to dial back, then carries
  the client's bytes to that connection and back, untouched.
- ``relay``: a board dialling back for such a client.

Everything runs on one asyncio loop in its own thread, so ten thousand idle
board links cost ten thousand sockets and no threads. TLS, when the tracker
has a certificate, covers every connection on the port.

Ten thousand boards send ten thousand pings a second, and the same loop
carries every user's gRPC bytes. So a registered plain-TCP link is read from
a poll set of its own (one descriptor in the loop's selector) a bounded
number of links at a time: a burst of pings waits behind a user's request
instead of the request waiting behind the whole burst, and a ping costs a
read and a compare, without a protobuf message or the loop's per-event
machinery; a link's pings are answered once in two seconds, not each.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import select
import socket
import ssl
import threading
import time
from typing import Dict, Optional

from remote import errors
from remote.proto import pb
from remote.proto.frames import (PREFIX, PROTOCOL_VERSION, error_frame, frame_bytes, splice,
                                 version_error)

log = logging.getLogger("tether.tracker")

# A frame on this port is small: registration with capabilities at most.
MAX_FRAME_BYTES = 256 * 1024
FIRST_FRAME_S = 10.0
RELAY_CONNECT_S = 10.0
REACH_TIMEOUT_S = 2.0
WRITE_HIGH_WATER = 4 << 20
# Connections that have not yet said who they are (before their first frame,
# or while a registration is checked), at most: from one address and in all.
# One address may be a farm's NAT, and a farm's boards come up together
# (benchmarks/board_sim.py registers 500 at once), so the first is large.
MAX_OPENING_PER_SOURCE = 1024
MAX_OPENING = 8192
# Bytes of unfinished first frames held, at most, over all such connections;
# a connection whose frame would go past it is dropped.
MAX_OPENING_BYTES = 32 << 20
# Relayed sessions: waiting for their board to dial back (in all, per board),
# and carried at once (each holds two threads on a plain-TCP port).
MAX_RELAYS_WAITING = 256
MAX_RELAYS_WAITING_PER_DEVICE = 8
MAX_RELAYS = 512
# gRPC connections past their first call, at most, from one address and in all.
MAX_GRPC_PER_SOURCE = 512
MAX_GRPC = 4096
_H2_PREFACE_BYTES = 24
_H2_HEADERS = 1
# Links read per turn of the loop before it serves its other sockets again.
LINK_BATCH = 256
LINK_READ_BYTES = 64 * 1024
_PONG = frame_bytes(pb.DataFrame(op="ok"))
# A link's pings are answered at most this often (a board gives its tracker up
# after 3 ping intervals and 5 s of silence; docs/protocol.md).
PONG_EVERY_S = 2.0
_monotonic = time.monotonic
# A board's ping, byte for byte as every board sends it (no id, nothing else set).
_PING = frame_bytes(pb.DataFrame(op="ping"))


def _only_pings(data: bytes) -> bool:
    count, rest = divmod(len(data), len(_PING))
    return not rest and data == _PING * count


class Conn(asyncio.Protocol):
    """One connection on the tracker's port; its role is set by its first bytes."""

    def __init__(self, door: "FrontDoor"):
        self.door = door
        self.transport: Optional[asyncio.Transport] = None
        self.buffer = bytearray()
        self.role = "new"          # new, link, waiting, spliced
        self.peer: Optional[Conn] = None
        self.device_id = ""
        self.peer_name = "?"
        self._first_timer = None
        self.answered = -PONG_EVERY_S  # when a ping was last answered
        self.fd = -1               # set while the link is read from the door's link poll set
        self.source = ""           # the peer's address while it counts as opening
        self.held = 0              # bytes of its unfinished first frame counted by the door
        self.grpc_source = ""      # the peer's address while it counts as a gRPC connection
        self._h2 = None            # a gRPC caller's bytes until its first call (HEADERS)
        self._h2_skip = 0

    # ----------------------------------------------------------- transport --
    def connection_made(self, transport):
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        peer = transport.get_extra_info("peername")
        self.peer_name = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if not self.door.opening(self, peer[0] if isinstance(peer, tuple) else self.peer_name):
            self.role = "refused"
            transport.abort()
            return
        self._first_timer = self.door.loop.call_later(FIRST_FRAME_S, self._first_too_slow)

    def _stop_first_timer(self):
        # Dropped, not only cancelled: ten thousand links would otherwise keep
        # thirty thousand objects (timer, context, bound method) for nothing.
        if self._first_timer is not None:
            self._first_timer.cancel()
            self._first_timer = None

    def _first_too_slow(self):
        if self.role == "new" or self._h2 is not None:
            self.transport.abort()

    def _grpc_bytes(self, data) -> None:
        """Follow a gRPC caller's HTTP/2 frames until its first call (a HEADERS
        frame): until then it is an opening connection, under the same deadline
        and caps as any other; one that sends the preface and stops is cut off."""
        buf = self._h2
        buf += data
        while True:
            if self._h2_skip:
                n = min(self._h2_skip, len(buf))
                del buf[:n]
                self._h2_skip -= n
                if self._h2_skip:
                    return
            if len(buf) < 9:
                return
            if buf[3] == _H2_HEADERS:
                break
            self._h2_skip = 9 + int.from_bytes(buf[:3], "big")
        self._h2 = None
        self._stop_first_timer()
        self.door.opened(self)
        if not self.door.calling(self):
            self.transport.abort()

    def connection_lost(self, exc):
        self._stop_first_timer()
        self.door.opened(self)
        self.door.hung_up(self)
        if self.fd >= 0:
            self.door.unwatch(self)
        if self.role == "link":
            self.door.link_lost(self)
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()
        self.peer = None
        self.door.forget_pending(self)

    def pause_writing(self):
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self):
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def data_received(self, data):
        if self.role == "link" and not self.buffer and (data == _PING or _only_pings(data)):
            # Nearly everything a large farm sends: ten thousand boards make ten
            # thousand of these a second (several at once from a board whose
            # link waited while the loop was busy). Recognised by their bytes
            # and answered with bytes made once, without protobuf either way.
            self.door.service.board_seen(self.device_id)
            self.answer_ping()
            return
        if self.role == "spliced":
            if self._h2 is not None:
                self._grpc_bytes(data)
            self.peer.transport.write(data)
            return
        if self.role == "refused":
            return
        self.buffer += data
        if self.source and not self.door.hold(self, len(self.buffer)):
            self.role = "refused"
            self.buffer = bytearray()
            self.transport.abort()
            return
        if self.role == "new" and len(self.buffer) >= 4 and self.buffer.startswith(b"PRI "):
            self.role = "waiting"
            self._h2, self._h2_skip = bytearray(), _H2_PREFACE_BYTES
            self._grpc_bytes(self.buffer)
            if not self.transport.is_closing():
                self.door.loop.create_task(self.door.splice_grpc(self))
            return
        if self.role == "waiting":
            if self._h2 is not None:
                self._grpc_bytes(data)
            return
        while len(self.buffer) >= PREFIX.size:
            head_len, body_len = PREFIX.unpack_from(self.buffer)
            if head_len + body_len > MAX_FRAME_BYTES:
                self.refuse("InvalidArgument", "frame too large for the tracker's port; "
                            "is this a Tether board or client of the same version?")
                return
            end = PREFIX.size + head_len + body_len
            if len(self.buffer) < end:
                return
            raw = bytes(self.buffer[:end])
            del self.buffer[:end]
            try:
                frame = pb.DataFrame.FromString(raw[PREFIX.size:PREFIX.size + head_len])
            except Exception:  # noqa: BLE001 - protobuf's DecodeError differs by version
                self.refuse("InvalidArgument", "not a Tether frame")
                return
            try:
                self.frame_received(frame, raw)
            except errors.TetherError as exc:
                self.refuse(type(exc).__name__, str(exc), id=frame.id)
                return
            if self.role in ("waiting", "spliced"):
                return

    # -------------------------------------------------------------- frames --
    def answer_ping(self) -> None:
        """Answer a board's ping if this link has not been answered for
        ``PONG_EVERY_S``: a board needs to hear from its tracker now and then,
        not at every ping. With ten thousand boards, a write per ping took
        about 30 % of a core of this machine's idle tracker (a write in two
        seconds per link: 21 %)."""
        now = _monotonic()
        if now - self.answered >= PONG_EVERY_S:
            self.answered = now
            self.transport.write(_PONG)

    def send(self, frame) -> None:
        self.transport.write(frame_bytes(frame))

    def refuse(self, error_class: str, text: str, id: int = 0) -> None:
        frame = error_frame(error_class, text)
        frame.id = id
        self.send(frame)
        if self.role != "link" or not id:
            self.transport.close()

    def frame_received(self, frame, raw: bytes) -> None:
        if self.role == "new":
            self._stop_first_timer()
            if frame.version != PROTOCOL_VERSION:
                raise errors.ConnectionFailed(version_error(frame.version, "caller"))
            if frame.op == "register":
                # Before anything is done for it (reaching its address, say).
                self.door.service.check_secret(frame.farm_secret)
                self.role = "waiting"
                self.transport.pause_reading()
                self.door.loop.create_task(self.door.register(self, frame))
            elif frame.op in ("open", "status", "close"):
                self.door.opened(self)
                self.door.relay_client(self, frame, raw)
            elif frame.op == "relay":
                self.door.opened(self)
                self.door.relay_board(self, frame)
            else:
                raise errors.InvalidArgument(f"a connection to the tracker's port begins with "
                                             f"register, open, status, close or relay, "
                                             f"not {frame.op!r}")
            return
        self.door.link_frame(self, frame)

    def splice_to(self, other: "Conn", first: bytes = b"") -> None:
        """From now on, bytes from either side go to the other unchanged."""
        self.peer, other.peer = other, self
        if first:
            other.transport.write(first)
        for a, b in ((self, other), (other, self)):
            a.role = "spliced"
            if a.buffer:
                b.transport.write(bytes(a.buffer))
                a.buffer.clear()
        self.transport.resume_reading()
        other.transport.resume_reading()


def _detach(conn: Conn) -> socket.socket:
    """The connection's socket, taken from the loop as a blocking socket."""
    sock = conn.transport.get_extra_info("socket")
    own = socket.socket(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno()))
    own.setblocking(True)
    conn.role = "detached"
    conn.transport.abort()  # closes the loop's descriptor; the connection lives on in ``own``
    return own


class _GrpcSide(asyncio.Protocol):
    """The tracker's own gRPC server, as the far end of a spliced connection."""

    def __init__(self, client: Conn):
        self.conn = Conn(client.door)
        self.conn.role = "spliced"
        self.name = ""  # the peer name gRPC gives the caller

    def connection_made(self, transport):
        self.conn.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def data_received(self, data):
        self.conn.peer.transport.write(data)

    def connection_lost(self, exc):
        self.conn.door.spliced_off(self.name)
        if self.conn.peer is not None:
            self.conn.peer.transport.close()

    def pause_writing(self):
        self.conn.pause_writing()

    def resume_writing(self):
        self.conn.resume_writing()


class CountBySource:
    """Connections of one kind counted per source address and in all, under caps."""

    def __init__(self, per_source: int, in_all: int):
        self.per_source, self.in_all = per_source, in_all
        self._counts: Dict[str, int] = {}
        self.total = 0

    def of(self, source: str) -> int:
        return self._counts.get(source, 0)

    def add(self, source: str) -> bool:
        """Count one more from ``source``; False (and nothing counted) past a cap."""
        mine = self._counts.get(source, 0)
        if mine >= self.per_source or self.total >= self.in_all:
            return False
        self._counts[source] = mine + 1
        self.total += 1
        return True

    def remove(self, source: str) -> None:
        left = self._counts[source] - 1
        if left:
            self._counts[source] = left
        else:
            del self._counts[source]
        self.total -= 1


class FrontDoor:
    """The tracker's listening port and its asyncio loop (in a thread)."""

    def __init__(self, service, host: str, port: int, grpc_path: str,
                 tls: Optional[ssl.SSLContext]):
        self.service = service
        self.grpc_path = grpc_path
        self.tls = tls
        self.loop = asyncio.new_event_loop()
        self.links: Dict[str, Conn] = {}           # device_id -> its link
        self._pending: Dict[str, Conn] = {}        # relay id -> client waiting for its board
        self._opening = CountBySource(MAX_OPENING_PER_SOURCE, MAX_OPENING)
        self._opening_bytes = 0
        self._grpc = CountBySource(MAX_GRPC_PER_SOURCE, MAX_GRPC)
        self._splices = itertools.count()
        self._callers: Dict[str, str] = {}         # gRPC's peer name -> the caller's address
        self._relays = 0                           # relayed sessions being carried
        self._relays_lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        sock.listen(4096)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self._server = self.loop.run_until_complete(self.loop.create_server(
            lambda: Conn(self), sock=sock, ssl=tls, backlog=4096,
            ssl_handshake_timeout=FIRST_FRAME_S if tls else None))
        # Stamped by the loop itself every tick: when it is busy the stamp ages,
        # and the service does not take the boards' unread pings for silence.
        self.last_tick = time.monotonic()
        # Registered plain-TCP links, read a batch at a time (see the module's
        # docstring); TLS links stay with the loop's transports.
        self._link_poll = select.epoll() if hasattr(select, "epoll") else None
        self._watched: Dict[int, Conn] = {}       # descriptor -> link read from the poll set
        self._links_behind = False                # the last batch was full: more may wait
        if self._link_poll is not None:
            self.loop.add_reader(self._link_poll.fileno(), self._read_links)
        self.loop.call_soon(self._tick)
        self._thread = threading.Thread(target=self.loop.run_forever, name="tracker-port",
                                        daemon=True)
        self._thread.start()

    def _tick(self):
        if self._links_behind:
            self._read_links()
        # Pings still waiting in links the loop has not reached are not silence.
        if not self._links_behind:
            self.last_tick = time.monotonic()
        self.loop.call_later(0.1, self._tick)

    def close(self):
        def stop():
            self._server.close()
            for conn in list(self.links.values()):
                conn.transport.abort()
            self.loop.stop()
        self.loop.call_soon_threadsafe(stop)
        self._thread.join(10)
        if self._link_poll is not None:
            self._link_poll.close()

    # ------------------------------------------------- links' poll set --
    def _watch(self, conn: Conn) -> bool:
        """Read a registered link from the link poll set; False where it cannot be."""
        if self._link_poll is None or conn.transport.get_extra_info("sslcontext") is not None:
            return False
        fd = conn.transport.get_extra_info("socket").fileno()
        self._link_poll.register(fd, select.EPOLLIN)
        self._watched[fd] = conn
        conn.fd = fd
        return True

    def unwatch(self, conn: Conn) -> None:
        """Before its transport closes the descriptor (which may then be reused)."""
        if self._watched.get(conn.fd) is conn:
            del self._watched[conn.fd]
            try:
                self._link_poll.unregister(conn.fd)
            except (OSError, ValueError):
                pass
        conn.fd = -1

    def _read_links(self) -> None:
        events = self._link_poll.poll(0, LINK_BATCH)
        self._links_behind = len(events) == LINK_BATCH
        for fd, _ in events:
            conn = self._watched.get(fd)
            if conn is None:
                continue
            if conn.transport.is_closing():  # evicted or replaced: nothing more to read
                self.unwatch(conn)
                continue
            try:
                data = os.read(fd, LINK_READ_BYTES)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                conn.data_received(data)
            else:
                conn.transport.abort()   # connection_lost: the board is dropped at once

    def call(self, fn, *args):
        """Run ``fn(*args)`` on the loop from another thread."""
        self.loop.call_soon_threadsafe(fn, *args)

    # -------------------------------------------------- opening connections --
    def opening(self, conn: Conn, source: str) -> bool:
        """Count a new connection against the caps on connections that have not
        said who they are; False: it is over a cap and is dropped."""
        if not self._opening.add(source):
            log.warning("refused a connection from %s: %d connections from it and %d in all "
                        "are still opening", source, self._opening.of(source), self._opening.total)
            return False
        conn.source = source
        return True

    def hold(self, conn: Conn, size: int) -> bool:
        """Count ``size`` bytes buffered by an opening connection; False past the budget."""
        grown = size - conn.held
        if grown > 0 and self._opening_bytes + grown > MAX_OPENING_BYTES:
            log.warning("dropped %s: unfinished first frames already hold %d bytes",
                        conn.peer_name, self._opening_bytes)
            return False
        self._opening_bytes += grown
        conn.held = size
        return True

    def calling(self, conn: Conn) -> bool:
        """Count a gRPC connection that made its first call; False: over a cap."""
        source = conn.peer_name.rsplit(":", 1)[0]
        if not self._grpc.add(source):
            log.warning("refused a gRPC connection from %s: %d from it and %d in all are open",
                        source, self._grpc.of(source), self._grpc.total)
            return False
        conn.grpc_source = source
        return True

    def hung_up(self, conn: Conn) -> None:
        if not conn.grpc_source:
            return
        self._grpc.remove(conn.grpc_source)
        conn.grpc_source = ""

    def opened(self, conn: Conn) -> None:
        """The connection said who it is (or ended): it no longer counts as opening."""
        if not conn.source:
            return
        self._opening.remove(conn.source)
        self._opening_bytes -= conn.held
        conn.source, conn.held = "", 0

    # ----------------------------------------------------------------- gRPC --
    async def splice_grpc(self, client: Conn):
        # The gRPC server sees every caller as this side of the splice: a
        # socket bound to a name of its own (in the abstract namespace, no
        # file) lets the service learn the caller's address from the peer
        # gRPC names (source_of).
        name = f"tether-grpc-{os.getpid()}-{next(self._splices)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind("\0" + name)
            sock.setblocking(False)
            await self.loop.sock_connect(sock, self.grpc_path)
            _, side = await self.loop.create_unix_connection(lambda: _GrpcSide(client), sock=sock)
        except OSError as exc:
            sock.close()
            log.error("the tracker's gRPC server is unreachable: %s", exc)
            client.transport.close()
            return
        if client.transport.is_closing():
            side.conn.transport.close()
            return
        side.name = "unix-abstract:" + name
        self._callers[side.name] = client.peer_name.rsplit(":", 1)[0]
        client.splice_to(side.conn)

    def source_of(self, peer: str) -> str:
        """The address of the caller gRPC names ``peer`` (its context.peer()),
        or ``peer`` itself when it came by another way."""
        return self._callers.get(peer, peer)

    def spliced_off(self, name: str) -> None:
        self._callers.pop(name, None)

    # --------------------------------------------------------------- links --
    async def register(self, conn: Conn, frame) -> None:
        reachable = not frame.relay and bool(frame.address) and await self._reachable(frame.address)
        if conn.transport.is_closing():
            return
        self.opened(conn)
        try:
            device_id, credential, interval = self.service.board_register(
                frame, relayed=not reachable)
        except errors.TetherError as exc:
            conn.refuse(type(exc).__name__, str(exc))
            return
        old = self.links.get(device_id)
        if old is not None and old is not conn:
            old.role = "replaced"
            old.transport.close()
        conn.role = "link"
        conn.device_id = device_id
        self.links[device_id] = conn
        conn.send(pb.DataFrame(op="ok", name=device_id, token=credential, seconds=interval))
        if not self._watch(conn):
            conn.transport.resume_reading()
        if conn.buffer:
            conn.data_received(b"")

    async def _reachable(self, address: str) -> bool:
        """Whether the tracker can open a connection to a board's address; a
        board it cannot reach gets its sessions through the relay."""
        host, _, port = address.rpartition(":")
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(host.strip("[]"), int(port)), REACH_TIMEOUT_S)
        except (OSError, ValueError, asyncio.TimeoutError):
            log.info("cannot reach %s: its sessions go through this tracker", address)
            return False
        writer.close()
        return True

    def link_frame(self, conn: Conn, frame) -> None:
        service = self.service
        if frame.op == "ping":
            service.board_seen(conn.device_id)
            if frame.id:
                conn.send(pb.DataFrame(op="ok", id=frame.id))
            else:
                conn.answer_ping()
            return
        service.board_seen(conn.device_id)
        if frame.op == "redeem":
            service.board_redeem(conn.device_id, frame.token)
        elif frame.op == "release":
            service.board_release(conn.device_id, frame.token)
        elif frame.op in ("ok", "error"):
            return
        else:
            raise errors.InvalidArgument(f"unknown request {frame.op!r} on a board link")
        conn.send(pb.DataFrame(op="ok", id=frame.id))

    def link_lost(self, conn: Conn) -> None:
        if self.links.get(conn.device_id) is conn:
            del self.links[conn.device_id]
            self.service.board_gone(conn.device_id, "its link to the tracker closed")

    def evicted(self, device_id: str) -> None:
        """The service dropped a silent board: close its link too."""
        conn = self.links.pop(device_id, None)
        if conn is not None:
            conn.role = "evicted"
            conn.transport.close()

    # --------------------------------------------------------------- relay --
    def relay_client(self, conn: Conn, frame, raw: bytes) -> None:
        if frame.op == "open":
            device_id = self.service.relay_target(frame.token)
        else:
            device_id = frame.device_id
            self.service.check_session_token(device_id, frame.token)
        link = self.links.get(device_id)
        if link is None:
            raise errors.ConnectionFailed(
                f"device {device_id or '(unknown)'} has no link to this tracker now; "
                "request a device again")
        waiting_here = sum(1 for c in self._pending.values() if c.device_id == device_id)
        with self._relays_lock:
            carried = self._relays
        if (len(self._pending) >= MAX_RELAYS_WAITING or carried >= MAX_RELAYS
                or waiting_here >= MAX_RELAYS_WAITING_PER_DEVICE):
            raise errors.DeviceBusy(
                f"the tracker already carries {carried} relayed sessions and {len(self._pending)} "
                f"wait for their board ({waiting_here} for device {device_id}), its limit; "
                "try again later")
        relay_id = secrets.token_urlsafe(18)
        conn.device_id = device_id
        conn.role = "waiting"
        conn.transport.pause_reading()
        conn.relay_first = raw
        conn.relay_id = relay_id
        self._pending[relay_id] = conn
        link.send(pb.DataFrame(op="relay", name=relay_id))
        self.loop.call_later(RELAY_CONNECT_S, self._relay_too_slow, relay_id, device_id)

    def _relay_too_slow(self, relay_id: str, device_id: str):
        conn = self._pending.pop(relay_id, None)
        if conn is not None:
            conn.role = "new"
            conn.refuse("ConnectionFailed", f"device {device_id} did not connect back to the "
                        f"tracker within {RELAY_CONNECT_S:g} s to carry this session")

    def relay_board(self, conn: Conn, frame) -> None:
        self.service.check_secret(frame.farm_secret)
        client = self._pending.pop(frame.name, None)
        if client is None:
            raise errors.AuthenticationError("unknown or expired relay id")
        if self.tls is not None:
            client.splice_to(conn, first=client.relay_first)
            return
        # Plain TCP: the session's bytes go between two blocking sockets in two
        # threads, off the loop that serves every board's pings; a relayed
        # call then costs two thread wake-ups more than a direct one.
        board_sock, client_sock = _detach(conn), _detach(client)
        try:
            board_sock.sendall(client.relay_first + bytes(client.buffer))
            if conn.buffer:
                client_sock.sendall(bytes(conn.buffer))
        except OSError:
            board_sock.close()
            client_sock.close()
            return
        with self._relays_lock:
            self._relays += 1
        splice(client_sock, board_sock, "relay", on_done=self._relay_done)

    def _relay_done(self) -> None:
        with self._relays_lock:
            self._relays -= 1

    def forget_pending(self, conn: Conn) -> None:
        relay_id = getattr(conn, "relay_id", None)
        if relay_id is not None:
            self._pending.pop(relay_id, None)

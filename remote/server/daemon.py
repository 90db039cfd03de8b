"""Start a device server: its port, its sessions, and the link to a tracker when there is one."""
from __future__ import annotations

import argparse
import itertools
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Optional

from remote.address import split_address
from remote.defaults import (FARM_SECRET_ENV, SERVER_PORT, TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV,
                             TRACKER_HELP, TRACKER_PORT, default_tracker)
from remote.proto.frames import PREFIX
from remote.lifecycle import start_logging, wait_for_stop_signal
from remote.server.isolation import (DEFAULT_SESSION_UIDS, Sandbox, check_secret_file,
                                     hide_from_modules, parse_session_limit, parse_uid_range,
                                     read_secret_file)
from remote.server.registration import TrackerLink, local_address_towards
from remote.server.service import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_UPLOAD_BYTES, DeviceService
from remote.tls import server_context

log = logging.getLogger("tether.server")

# Connections that have not yet sent their whole first frame wait in one
# poll set, costing a descriptor and no thread: at most MAX_WAITING of them,
# MAX_WAITING_PER_SOURCE from one address (past it, that address's oldest is
# dropped: a client that means it sends its first frame at once, so an idle
# crowd cannot keep it out). Each must finish its TLS handshake and first frame
# within HELLO_DEADLINE_S, however slowly its bytes arrive. Only a connection
# whose first frame has arrived whole gets one of MAX_PENDING threads.
MAX_PENDING = 64
MAX_WAITING = 1024
MAX_WAITING_PER_SOURCE = 256
HELLO_DEADLINE_S = 10.0
FIRST_FRAME_BYTES = 64 * 1024
# A connection with part of its first frame is looked at again this often
# (its bytes keep it readable: polling it at once would spin).
PARTIAL_RECHECK_S = 0.05


class Listener:
    """Accepts connections on the server's port, waits for each one's first
    frame in one poll set, and gives it to the service in a thread of a pool."""

    def __init__(self, host: str, port: int, service: DeviceService,
                 tls: Optional[ssl.SSLContext]):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.service = service
        self.tls = tls
        # Threads are kept between connections: starting one per connection
        # cost a good part of opening a session.
        self._threads = ThreadPoolExecutor(MAX_PENDING, thread_name_prefix="first-frame")
        self._deadlines = Deadlines()
        self._waiting: "OrderedDict[socket.socket, tuple]" = OrderedDict()  # oldest first
        self._per_source: Dict[str, int] = {}
        self._closed = False
        threading.Thread(target=self._loop, name="accept", daemon=True).start()

    def _loop(self):
        poller = selectors.DefaultSelector()
        poller.register(self.sock, selectors.EVENT_READ)
        later = []  # (when, conn): partial first frames, looked at again then
        while not self._closed:
            now = time.monotonic()
            timeout = max(0.0, min([when for when, _ in later] + [now + 0.5]) - now)
            try:
                events = poller.select(timeout)
            except (OSError, ValueError):
                return
            for key, _ in events:
                if key.fileobj is self.sock:
                    self._accept(poller)
                else:
                    self._readable(poller, key.fileobj, later)
            now = time.monotonic()
            due = [conn for when, conn in later if when <= now]
            later[:] = [(when, conn) for when, conn in later if when > now]
            for conn in due:
                if conn in self._waiting:
                    poller.register(conn, selectors.EVENT_READ)
            for conn, (deadline, _, _) in list(self._waiting.items()):
                if deadline > now:
                    break  # in order of arrival, so of deadline too
                self._drop(poller, conn)

    def _accept(self, poller):
        try:
            conn, peer = self.sock.accept()
        except OSError:
            return
        source = peer[0]
        if self._per_source.get(source, 0) >= MAX_WAITING_PER_SOURCE:
            oldest = next(c for c, (_, _, s) in self._waiting.items() if s == source)
            log.warning("dropped the oldest of %d connections from %s still opening",
                        MAX_WAITING_PER_SOURCE, source)
            self._drop(poller, oldest)
        elif len(self._waiting) >= MAX_WAITING:
            log.warning("dropped the oldest of %d connections still opening", MAX_WAITING)
            self._drop(poller, next(iter(self._waiting)))
        self._waiting[conn] = (time.monotonic() + HELLO_DEADLINE_S, peer, source)
        self._per_source[source] = self._per_source.get(source, 0) + 1
        conn.setblocking(False)
        poller.register(conn, selectors.EVENT_READ)

    def _readable(self, poller, conn: socket.socket, later) -> None:
        if self.tls is None and not _first_frame_arrived(conn):
            poller.unregister(conn)
            later.append((time.monotonic() + PARTIAL_RECHECK_S, conn))
            return
        # A whole first frame (or, with TLS, the handshake's first bytes, read
        # under the deadline in the thread).
        deadline, peer = self._forget(poller, conn)[:2]
        conn.setblocking(True)
        self._threads.submit(self._first_frame, conn, peer, deadline - time.monotonic())

    def _forget(self, poller, conn: socket.socket):
        entry = self._waiting.pop(conn)
        left = self._per_source[entry[2]] - 1
        if left:
            self._per_source[entry[2]] = left
        else:
            del self._per_source[entry[2]]
        try:
            poller.unregister(conn)
        except (KeyError, ValueError):
            pass  # waiting for its recheck
        return entry

    def _drop(self, poller, conn: socket.socket) -> None:
        self._forget(poller, conn)
        conn.close()

    def _first_frame(self, conn: socket.socket, peer, left_s: float):
        where = f"{peer[0]}:{peer[1]}"
        # One deadline for the whole hello, not per recv: a peer that trickles
        # a byte at a time is cut off all the same.
        key = self._deadlines.add(conn, max(left_s, 0.0))
        try:
            if self.tls is not None:
                # The handshake reads with a timeout of its own (wrapping takes
                # the socket the deadline was set on).
                conn.settimeout(max(left_s, 0.001))
                try:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                except (ssl.SSLError, OSError) as exc:
                    log.info("TLS handshake with %s failed: %s", where, exc)
                    conn.close()
                    return
                conn.settimeout(None)
                self._deadlines.replace(key, conn)
            self.service.handle(conn, where, lambda: self._deadlines.remove(key))
        except Exception:  # noqa: BLE001 - one connection's failure is logged, not fatal
            log.exception("connection from %s", where)
        finally:
            self._deadlines.remove(key)

    def close(self):
        self._closed = True
        self.sock.close()
        self._threads.shutdown(wait=False)


def _first_frame_arrived(conn: socket.socket) -> bool:
    """Whether a whole first frame waits in ``conn`` (looked at, not read): true
    too for what is not a frame at all, or has ended, which the service answers."""
    try:
        head = conn.recv(PREFIX.size + FIRST_FRAME_BYTES, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    except OSError:
        return True
    if len(head) < PREFIX.size:
        return not head  # closed: let the service see it end
    head_len, body_len = PREFIX.unpack_from(head)
    if head_len > FIRST_FRAME_BYTES or body_len:
        return True   # not a first frame this server takes: it says so at once
    return len(head) >= PREFIX.size + head_len


class Deadlines:
    """Shuts down sockets whose deadline passed, from one thread for all of them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending = {}
        self._keys = itertools.count()
        threading.Thread(target=self._loop, name="deadlines", daemon=True).start()

    def add(self, sock: socket.socket, seconds: float) -> int:
        key = next(self._keys)
        with self._lock:
            self._pending[key] = (time.monotonic() + seconds, sock)
        return key

    def replace(self, key: int, sock: socket.socket) -> None:
        """Apply ``key``'s deadline to another socket (the TLS one over it)."""
        with self._lock:
            if key in self._pending:
                self._pending[key] = (self._pending[key][0], sock)

    def remove(self, key: int) -> None:
        with self._lock:
            self._pending.pop(key, None)

    def _loop(self):
        while True:
            time.sleep(0.25)
            now = time.monotonic()
            with self._lock:
                late = [k for k, (deadline, _) in self._pending.items() if deadline < now]
                socks = [self._pending.pop(k)[1] for k in late]
            for sock in socks:
                _shut(sock)


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class RunningServer:
    """A started device server; ``stop()`` ends it."""

    def __init__(self, listener: Listener, service: DeviceService, link: Optional[TrackerLink]):
        self.listener = listener
        self.service = service
        self.port = listener.port
        self.link = link

    def stop(self, grace: float = 1.0):
        self.listener.close()
        if self.link is not None:
            self.link.close()
        self.service.close()


def serve(host: str = "0.0.0.0", port: int = SERVER_PORT, tracker: Optional[str] = None,
          key: Optional[str] = None, advertise: Optional[str] = None,
          farm_secret: str = "", attributes: Optional[Dict[str, str]] = None,
          max_sessions: int = 1, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
          max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES, session_queue_s: float = 0.0,
          cc: str = "cc", workspace_dir: Optional[str] = None, tls_cert: str = "",
          tls_key: str = "", tls_ca: str = "", relay: bool = False,
          session_limits=(), allow_network: bool = False, sandbox: bool = True,
          session_uids: Optional[range] = None, hidden=()) -> RunningServer:
    """Start serving; with ``tracker`` and ``key`` the server registers and needs leases.

    ``tls_cert``/``tls_key`` serve clients over TLS; ``tls_ca`` is the certificate
    to trust when talking to a TLS tracker. ``relay`` takes no sessions on this
    port: clients reach the board through the tracker (for boards behind NAT).
    ``sandbox``, ``allow_network``, ``session_uids`` and ``hidden`` (files no
    session may read) set the session sandbox (docs/security.md).

    >>> srv = serve("127.0.0.1", 0)            # doctest: +SKIP
    """
    if (tracker is None) != (key is None):
        raise ValueError("give both a tracker address and a key, or neither")
    if relay and tracker is None:
        raise ValueError("--relay needs a tracker to relay through (--tracker, --key)")
    context = server_context(tls_cert, tls_key)
    isolation = Sandbox(sandbox, allow_network, session_uids, hidden)
    log.warning("sandbox: sessions are isolated by %s", isolation.level.replace(",", ", "))
    for missing in isolation.missing:
        log.warning("sandbox: %s", missing)
    service = DeviceService(max_sessions=max_sessions, idle_timeout_s=idle_timeout_s,
                            max_upload_bytes=max_upload_bytes, attributes=attributes,
                            session_queue_s=session_queue_s, cc=cc,
                            workspace_parent=workspace_dir, session_limits=session_limits,
                            sandbox=isolation)
    try:
        listener = Listener(host, port, service, context)
    except BaseException:
        service.close()
        raise
    link = None
    if tracker is not None:
        if relay:
            advertise = ""
        elif advertise is None:
            t_host, t_port = split_address(tracker, TRACKER_PORT)
            local = host if host not in ("0.0.0.0", "::", "") else local_address_towards(t_host, t_port)
            advertise = f"{local}:{listener.port}"
        elif ":" not in advertise:
            advertise = f"{advertise}:{listener.port}"
        link = TrackerLink(tracker, key, advertise, service.info, farm_secret, tls_ca,
                           on_relay=lambda sock: service.handle(sock, f"relay via {tracker}"),
                           live_tokens=service.live_tokens)
        service.attach_tracker(link.redeem, link.release)
        link.start()
    return RunningServer(listener, service, link)


def _session_limit(text: str):
    try:
        return parse_session_limit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _uid_range(text: str):
    try:
        return parse_uid_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _attribute(text: str):
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"attribute {text!r} must look like name=value")
    return name, value


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="python -m remote.server",
        description="Run a Tether device server on this board.",
        epilog="example: python -m remote.server --tracker farm.local:9190 --key rasp4b64")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=SERVER_PORT,
                        help="port to listen on; 0 picks a free one")
    parser.add_argument("--tracker", help=TRACKER_HELP + "; used with --key")
    parser.add_argument("--key", help="device key to register under, e.g. rasp4b64 "
                                      "(without it the server stands alone)")
    parser.add_argument("--advertise", help="HOST[:PORT] clients should dial (default: found)")
    parser.add_argument("--relay", action="store_true",
                        help="take sessions only through the tracker, for a board that cannot "
                             "accept connections (behind NAT, outbound-only networks)")
    parser.add_argument("--farm-secret", default=os.environ.get(FARM_SECRET_ENV, ""),
                        help=f"secret the tracker requires (default ${FARM_SECRET_ENV}); "
                             "prefer --farm-secret-file: any process of this user can read a "
                             "command line or environment")
    parser.add_argument("--farm-secret-file", metavar="PATH",
                        help="file whose first line is the secret the tracker requires")
    parser.add_argument("--attr", action="append", type=_attribute, default=[],
                        metavar="NAME=VALUE", help="free-form attribute, e.g. board=rpi4")
    parser.add_argument("--max-sessions", type=int, default=1)
    parser.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S,
                        help="seconds after which a silent session is closed")
    parser.add_argument("--tls-cert", default=os.environ.get(TLS_CERT_ENV, ""),
                        help=f"PEM certificate: serve clients over TLS (default ${TLS_CERT_ENV})")
    parser.add_argument("--tls-key", default=os.environ.get(TLS_KEY_ENV, ""),
                        help=f"PEM private key of --tls-cert (default ${TLS_KEY_ENV})")
    parser.add_argument("--tls-ca", default=os.environ.get(TLS_CA_ENV, ""),
                        help=f"PEM certificate to trust for a TLS tracker (default ${TLS_CA_ENV})")
    parser.add_argument("--max-upload-bytes", type=int, default=DEFAULT_MAX_UPLOAD_BYTES,
                        help="largest file or tensor a client may send")
    parser.add_argument("--session-queue", type=float, default=0.0, metavar="SECONDS",
                        help="with --max-sessions sessions open, a new one waits this long "
                             "for a free slot before it is refused (default 0: refuse at once)")
    parser.add_argument("--workspace-dir", default=None,
                        help="folder in which session workspaces are made (default: the "
                             "system temp folder)")
    parser.add_argument("--allow-network", action="store_true",
                        help="let sessions' modules use the network (by default each session "
                             "runs in a network namespace of its own, with no interface up)")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="run sessions without namespaces or users of their own (their "
                             "processes still end with them); for measuring the sandbox's cost "
                             "or a board where it gets in the way")
    parser.add_argument("--session-uids", type=_uid_range, default=None, metavar="FIRST-LAST",
                        help="user ids for sessions when the server runs as root, each live "
                             f"session its own (default {DEFAULT_SESSION_UIDS}); no user of "
                             "this board may have one of them")
    parser.add_argument("--session-limit", type=_session_limit, action="append", default=[],
                        metavar="NAME=NUMBER",
                        help="a limit on every session's processes: as (bytes of address "
                             "space), nproc (processes of the session's user), fsize (bytes a file may "
                             "grow to), cpu (seconds of CPU time); repeat for several")
    parser.add_argument("--cc", default=os.environ.get("CC", "cc"),
                        help="C compiler that links uploaded .tar modules (default $CC or cc)")
    return parser


REGISTER_WAIT_S = 5.0


def run(args) -> int:
    """Serve until SIGINT/SIGTERM with the options parsed by ``build_parser``."""
    start_logging()
    hide_from_modules()
    log.warning("sandbox: %s", ", ".join(f"{n}={v}" for n, v in args.session_limit)
                if args.session_limit else "no --session-limit: a session may use all of the "
                "board's memory, disk and CPU until its timeouts end it")
    if args.farm_secret_file:
        check_secret_file(args.farm_secret_file)
        args.farm_secret = read_secret_file(args.farm_secret_file)
    tracker = (args.tracker or default_tracker()) if args.key else None
    server = serve(args.host, args.port, tracker=tracker, key=args.key if tracker else None,
                   advertise=args.advertise, farm_secret=args.farm_secret,
                   attributes=dict(args.attr), max_sessions=args.max_sessions,
                   idle_timeout_s=args.idle_timeout, max_upload_bytes=args.max_upload_bytes,
                   session_queue_s=args.session_queue, cc=args.cc,
                   workspace_dir=args.workspace_dir,
                   tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                   relay=args.relay, session_limits=args.session_limit,
                   allow_network=args.allow_network, sandbox=not args.no_sandbox,
                   session_uids=args.session_uids,
                   hidden=[args.farm_secret_file] if args.farm_secret_file else [])
    if server.link is None:
        where = "standalone"
    elif server.link.registered.wait(REGISTER_WAIT_S):
        where = f"registered with {tracker} as {args.key}"
    else:
        where = (f"not yet registered with {tracker}: {server.link.last_error or 'no answer'}; "
                 "retrying in the background")
    print(f"tether device server listening on {args.host}:{server.port} ({where})", flush=True)
    wait_for_stop_signal()
    server.stop()
    if server.link is None:  # a registered board's link says so with its lease counts
        logging.getLogger("tether.server").info("stopped")
    return 0

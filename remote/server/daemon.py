"""Start a device server: the gRPC server, and the tracker link when there is one."""
from __future__ import annotations

import argparse
import logging
import os
from concurrent import futures
from typing import Dict, Optional

import grpc

from remote import tls
from remote.defaults import (FARM_SECRET_ENV, SERVER_PORT, TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV,
                             TRACKER_ENV, TRACKER_PORT)
from remote.lifecycle import start_logging, wait_for_stop_signal
from remote.proto import CHANNEL_OPTIONS, add_servicer
from remote.address import split_address
from remote.server.registration import TrackerLink, local_address_towards
from remote.server.service import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_UPLOAD_BYTES, DeviceService

log = logging.getLogger("tether.server")


class RunningServer:
    """A started device server; ``stop()`` ends it."""

    def __init__(self, grpc_server, service: DeviceService, port: int,
                 link: Optional[TrackerLink]):
        self.grpc_server = grpc_server
        self.service = service
        self.port = port
        self.link = link

    def stop(self, grace: float = 1.0):
        if self.link is not None:
            self.link.close()
        self.service.close()
        self.grpc_server.stop(grace)


def serve(host: str = "0.0.0.0", port: int = SERVER_PORT, tracker: Optional[str] = None,
          key: Optional[str] = None, advertise: Optional[str] = None,
          farm_secret: str = "", attributes: Optional[Dict[str, str]] = None,
          max_sessions: int = 1, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
          max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES, session_queue_s: float = 0.0,
          cc: str = "cc", workspace_dir: Optional[str] = None, tls_cert: str = "",
          tls_key: str = "", tls_ca: str = "") -> RunningServer:
    """Start serving; with ``tracker`` and ``key`` the server registers and needs leases.

    ``tls_cert``/``tls_key`` serve clients over TLS; ``tls_ca`` is the certificate
    to trust when talking to a TLS tracker.

    >>> srv = serve("127.0.0.1", 0)            # doctest: +SKIP
    """
    if (tracker is None) != (key is None):
        raise ValueError("give both a tracker address and a key, or neither")
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=16,
                                                         thread_name_prefix="device"),
                              options=CHANNEL_OPTIONS)
    bound = tls.add_port(grpc_server, f"{host}:{port}", tls_cert, tls_key)
    service = DeviceService(max_sessions=max_sessions, idle_timeout_s=idle_timeout_s,
                            max_upload_bytes=max_upload_bytes, attributes=attributes,
                            host=host, session_queue_s=session_queue_s, cc=cc,
                            workspace_parent=workspace_dir, tls_cert=tls_cert, tls_key=tls_key)
    link = None
    if tracker is not None:
        if advertise is None:
            t_host, t_port = split_address(tracker, TRACKER_PORT)
            local = host if host not in ("0.0.0.0", "::", "") else local_address_towards(t_host, t_port)
            advertise = f"{local}:{bound}"
        elif ":" not in advertise:
            advertise = f"{advertise}:{bound}"
        link = TrackerLink(tracker, key, advertise, service.info, farm_secret, tls_ca)
        service.attach_tracker(link.redeem, link.release)
    add_servicer(grpc_server, "Device", service)
    grpc_server.start()
    if link is not None:
        link.start()
    return RunningServer(grpc_server, service, bound, link)


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
    parser.add_argument("--tracker", default=os.environ.get(TRACKER_ENV),
                        help=f"tracker HOST:PORT to register with (default ${TRACKER_ENV})")
    parser.add_argument("--key", help="device key to register under, e.g. rasp4b64")
    parser.add_argument("--advertise", help="HOST[:PORT] clients should dial (default: found)")
    parser.add_argument("--farm-secret", default=os.environ.get(FARM_SECRET_ENV, ""),
                        help=f"secret the tracker requires (default ${FARM_SECRET_ENV})")
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
    parser.add_argument("--cc", default=os.environ.get("CC", "cc"),
                        help="C compiler that links uploaded .tar modules (default $CC or cc)")
    return parser


def run(args) -> int:
    """Serve until SIGINT/SIGTERM with the options parsed by ``build_parser``."""
    start_logging()
    if args.key and not args.tracker:
        raise SystemExit(f"--key needs --tracker HOST:PORT (or set {TRACKER_ENV})")
    tracker = args.tracker if args.key else None
    server = serve(args.host, args.port, tracker=tracker, key=args.key if tracker else None,
                   advertise=args.advertise, farm_secret=args.farm_secret,
                   attributes=dict(args.attr), max_sessions=args.max_sessions,
                   idle_timeout_s=args.idle_timeout, max_upload_bytes=args.max_upload_bytes,
                   session_queue_s=args.session_queue, cc=args.cc,
                   workspace_dir=args.workspace_dir,
                   tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca)
    where = f"registered with {tracker} as {args.key}" if tracker else "standalone"
    print(f"tether device server listening on {args.host}:{server.port} ({where})", flush=True)
    wait_for_stop_signal()
    server.stop()
    return 0

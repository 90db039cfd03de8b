"""Command-line shell of the tracker (``tether tracker`` / ``python -m remote.tracker``)."""
from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
from typing import Optional

from remote.defaults import (FARM_SECRET_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TRACKER_PORT,
                             default_farm_db)
from remote.errors import InvalidArgument
from remote.lifecycle import start_logging, wait_for_stop_signal
from remote.tracker.service import EVICTION_WINDOW_S, UNUSED_LEASE_S, serve
from remote.tracker.tokens import DEFAULT_TOKENS_FILE


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="python -m remote.tracker", description="Run a Tether tracker.",
        epilog="example: python -m remote.tracker --host 0.0.0.0 --port 9190")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=TRACKER_PORT,
                        help=f"port to listen on (default {TRACKER_PORT})")
    parser.add_argument("--farm-secret", default=os.environ.get(FARM_SECRET_ENV, ""),
                        help=f"secret servers and clients must present (default ${FARM_SECRET_ENV})")
    parser.add_argument("--eviction-window", type=float, default=EVICTION_WINDOW_S,
                        help="seconds a board may stay silent on its link before it is dropped "
                             f"(default {EVICTION_WINDOW_S:g})")
    parser.add_argument("--unused-lease-timeout", type=float, default=UNUSED_LEASE_S,
                        help="seconds a granted lease may go unredeemed before the device "
                             f"returns to the pool (default {UNUSED_LEASE_S:g})")
    parser.add_argument("--http", type=int, default=None, metavar="PORT",
                        help="serve the farm page and Prometheus /metrics on this port "
                             "(0 picks a free one)")
    parser.add_argument("--require-tokens", action="store_true",
                        help="users need a token of their own (tether token add NAME) to request, "
                             "release and see the pool; the holder shown is the token's name")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS_FILE, metavar="FILE",
                        help=f"the token file (default {DEFAULT_TOKENS_FILE})")
    parser.add_argument("--db", default=None, metavar="URL",
                        help="the farm database that keeps every session, benchmark and "
                             "accuracy check: sqlite:///PATH or postgresql://USER@HOST/NAME "
                             f"(default {default_farm_db()}); 'none' keeps nothing")
    parser.add_argument("--tls-cert", default=os.environ.get(TLS_CERT_ENV, ""),
                        help=f"PEM certificate: serve over TLS (default ${TLS_CERT_ENV})")
    parser.add_argument("--tls-key", default=os.environ.get(TLS_KEY_ENV, ""),
                        help=f"PEM private key of --tls-cert (default ${TLS_KEY_ENV})")
    return parser


def _allow_many_links() -> None:
    """Every board keeps a connection open: raise the open-file limit to what
    the system allows (distributions start processes at 1,024)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ImportError, ValueError, OSError):
        pass


def _keep_boards_out_of_full_collections(service, stop: threading.Event) -> None:
    """Python's garbage collector now and then looks at every object the
    process holds, and ten thousand board links are over a hundred thousand:
    such a pass took 110-150 ms on a 2-core machine, and no request was
    answered meanwhile. What a farm holds lives as long as its boards, and
    reference counting frees it when they go, so once the number of boards
    has stayed the same for a second, the objects alive are moved out of the
    collector's sight (gc.freeze); its passes then look at recent objects only."""
    frozen, last = -1, -1
    while not stop.wait(1.0):
        count = service.board_count()
        if count == last and count != frozen:
            gc.freeze()
            frozen = count
        last = count


def run(args) -> int:
    start_logging()
    _allow_many_links()
    try:
        tracker = serve(args.host, args.port, farm_secret=args.farm_secret,
                        eviction_window_s=args.eviction_window,
                        unused_lease_s=args.unused_lease_timeout,
                        tls_cert=args.tls_cert, tls_key=args.tls_key,
                        tokens_file=args.tokens if args.require_tokens else None,
                        db_url=None if args.db == "none" else args.db or default_farm_db())
    except InvalidArgument as exc:  # a --db that cannot be opened: say which and why
        print(f"tether tracker: {exc}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    threading.Thread(target=_keep_boards_out_of_full_collections, args=(tracker.service, stop),
                     name="tracker-gc", daemon=True).start()
    mode = "TLS" if args.tls_cert else "plaintext"
    page = None
    if args.http is not None:
        from remote.tracker.web import FarmPage
        page = FarmPage(tracker.service, args.host, args.http)
    where = f"; farm page {page.url} and {page.url}metrics" if page else ""
    db = tracker.service.db
    kept = f"; results kept in {db.shown}" if db else "; no farm database"
    print(f"tether tracker listening on {args.host}:{tracker.port} ({mode}; clients and "
          f"boards alike){where}{kept}", flush=True)
    wait_for_stop_signal()
    stop.set()
    if page is not None:
        page.close()
    tracker.stop(1.0)
    return 0

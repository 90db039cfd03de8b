"""Command-line shell of the tracker (``tether tracker`` / ``python -m remote.tracker``)."""
from __future__ import annotations

import argparse
import os
from typing import Optional

from remote.lifecycle import start_logging, wait_for_stop_signal
from remote.tracker.service import EVICTION_WINDOW_S, serve


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(
        prog="python -m remote.tracker", description="Run a Tether tracker.",
        epilog="example: python -m remote.tracker --host 0.0.0.0 --port 9190")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=9190, help="port to listen on (default 9190)")
    parser.add_argument("--farm-secret", default=os.environ.get("TETHER_FARM_SECRET", ""),
                        help="secret servers and clients must present (default $TETHER_FARM_SECRET)")
    parser.add_argument("--eviction-window", type=float, default=EVICTION_WINDOW_S,
                        help="seconds without a heartbeat before a device is dropped")
    return parser


def run(args) -> int:
    start_logging()
    server, service, port = serve(args.host, args.port, farm_secret=args.farm_secret,
                                  eviction_window_s=args.eviction_window)
    print(f"tether tracker listening on {args.host}:{port}", flush=True)
    wait_for_stop_signal()
    service.close()
    server.stop(1.0)
    return 0

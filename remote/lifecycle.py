"""How the tracker and device server processes start logging and wait to be stopped."""
from __future__ import annotations

import logging
import signal
import threading


def start_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")


def wait_for_stop_signal() -> None:
    """Block until SIGINT or SIGTERM arrives."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()

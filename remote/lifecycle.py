"""How the tracker and device server processes start logging and wait to be stopped."""
from __future__ import annotations

import logging
import signal
import sys
import threading


def flush_each_line() -> None:
    """Make stdout and stderr write each line as it ends, piped or not.

    A person or a program (a test, a service manager) waits for these lines;
    with stdout on a pipe, Python would otherwise keep them in its buffer.
    """
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)


def start_logging() -> None:
    flush_each_line()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")


def wait_for_stop_signal() -> None:
    """Block until SIGINT or SIGTERM arrives."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()

"""Default ports and the environment variables Tether reads, named once.

Boards import it as well as hosts (the device server, the protocol layer and
TLS read the shared names), so it stays standard library only and is one of
the files shipped to a board.

    >>> TRACKER_PORT, SERVER_PORT
    (9190, 9090)
"""
from __future__ import annotations

import os

TRACKER_PORT = 9190  # the tracker's gRPC port
SERVER_PORT = 9090   # a device server's gRPC port

# Read on boards and hosts alike.
TRACKER_ENV = "TETHER_TRACKER"          # HOST:PORT of the tracker
FARM_SECRET_ENV = "TETHER_FARM_SECRET"  # the secret a tracker requires
TLS_CA_ENV = "TETHER_TLS_CA"            # PEM certificate a client trusts
TLS_CERT_ENV = "TETHER_TLS_CERT"        # PEM certificate a server presents
TLS_KEY_ENV = "TETHER_TLS_KEY"          # its private key
POLL_US_ENV = "TETHER_POLL_US"          # microseconds a frame reader polls before it sleeps
EMULATED_ENV = "TETHER_EMULATED"        # set by `tether emulate`: how the board is emulated

# Read on the host only.
TOKEN_ENV = "TETHER_TOKEN"              # a user's token for a tracker that requires one
CACHE_ENV = "TETHER_CACHE"              # root filesystems, tuned tiles, native servers
DEBIAN_MIRROR_ENV = "TETHER_DEBIAN_MIRROR"
SSH_PASSWORD_ENV = "TETHER_SSH_PASSWORD"

# One rule for every command that talks to a tracker, stated in every help text.
LOCAL_TRACKER = f"127.0.0.1:{TRACKER_PORT}"
TRACKER_HELP = f"tracker HOST:PORT (default: ${TRACKER_ENV}, else {LOCAL_TRACKER})"


def default_tracker() -> str:
    """The tracker a command uses when none is named: ``$TETHER_TRACKER``, else
    the one on this machine's default port."""
    return os.environ.get(TRACKER_ENV) or LOCAL_TRACKER


def cache_dir() -> str:
    """``$TETHER_CACHE``, else ``$XDG_CACHE_HOME/tether``, else ``~/.cache/tether``."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tether")

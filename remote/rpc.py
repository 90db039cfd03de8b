"""The notebook entry point.

    >>> from remote import rpc
    >>> tracker = rpc.connect_tracker("farm.local", 9190)          # doctest: +SKIP
    >>> with tracker.request("rasp4b64", timeout=30) as sess:      # doctest: +SKIP
    ...     sess.upload("net.so")
    ...     outputs = sess.load_module("net.so").run({"input": x})
"""
from __future__ import annotations

import os
from typing import Optional

from remote.client import RemoteModule, Session, TrackerClient
from remote.client.tracker import default_client_name
from remote.address import split_address
from remote.defaults import SERVER_PORT, TRACKER_ENV, TRACKER_PORT

__all__ = ["connect", "connect_tracker", "Session", "RemoteModule", "TrackerClient"]


def connect(host: str, port: int = SERVER_PORT, session_timeout: float = 0.0,
            timeout: Optional[float] = 30.0, tls_ca: Optional[str] = None) -> Session:
    """Open a session on a device server that is not behind a tracker.

    ``tls_ca`` (default ``$TETHER_TLS_CA``) is the PEM certificate to trust when
    the server serves TLS.
    """
    return Session(f"{host}:{port}", session_timeout=session_timeout,
                   client=default_client_name(), timeout=timeout, tls_ca=tls_ca)


def connect_tracker(host: Optional[str] = None, port: Optional[int] = None,
                    farm_secret: Optional[str] = None,
                    tls_ca: Optional[str] = None, token: Optional[str] = None) -> TrackerClient:
    """Connect to a tracker; without arguments, to ``$TETHER_TRACKER``.

    ``farm_secret`` defaults to ``$TETHER_FARM_SECRET``, ``tls_ca`` (the PEM
    certificate to trust for TLS) to ``$TETHER_TLS_CA`` and ``token`` (a user
    token, for a tracker that requires one) to ``$TETHER_TOKEN``.
    """
    if host is None:
        env = os.environ.get(TRACKER_ENV)
        if not env:
            raise ValueError(f"no tracker address: pass host and port or set {TRACKER_ENV}=host:port")
        host, port = split_address(env, TRACKER_PORT)
    return TrackerClient(host, TRACKER_PORT if port is None else port, farm_secret=farm_secret,
                         tls_ca=tls_ca, token=token)

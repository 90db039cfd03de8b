"""Plaintext or TLS, chosen by certificate files: gRPC channels and ports, and
the SSL contexts of framed connections (board protocol v2).

Tracker, device server and clients all make their connections and ports here, so
that TLS is switched on the same way everywhere: a server gets a certificate
and its key (``--tls-cert``/``--tls-key`` or ``TETHER_TLS_CERT``/``TETHER_TLS_KEY``),
a client gets the certificate to trust (``tls_ca=`` / ``--tls-ca`` or
``TETHER_TLS_CA``). With none of them set, traffic is plaintext.

    >>> channel = open_channel("127.0.0.1:9190")          # plaintext unless $TETHER_TLS_CA
"""
from __future__ import annotations

import os
import ssl
from typing import Optional

from remote.defaults import TLS_CA_ENV
from remote.proto import CHANNEL_OPTIONS


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise FileNotFoundError(f"cannot read the TLS {what} {path!r}: {exc.strerror}") from None


def default_ca(ca: Optional[str] = None) -> str:
    """``ca`` if given, else ``$TETHER_TLS_CA``, else "" (plaintext)."""
    return os.environ.get(TLS_CA_ENV, "") if ca is None else ca


def server_context(cert: str = "", key: str = "") -> Optional[ssl.SSLContext]:
    """The TLS context of a framed port (board, tracker), or None for plaintext."""
    if bool(cert) != bool(key):
        raise ValueError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
    if not cert:
        return None
    _read(cert, "certificate")
    _read(key, "private key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


def client_context(ca: str) -> Optional[ssl.SSLContext]:
    """The TLS context that trusts the PEM file ``ca``, or None for plaintext."""
    if not ca:
        return None
    _read(ca, "CA certificate")
    return ssl.create_default_context(cafile=ca)


def open_channel(address: str, ca: Optional[str] = None, options=None):
    """A gRPC channel to ``address``; TLS trusting the PEM file ``ca`` when one is given.

    ``ca=None`` falls back to ``$TETHER_TLS_CA``; ``ca=""`` forces plaintext.
    """
    import grpc

    ca = default_ca(ca)
    options = list(CHANNEL_OPTIONS if options is None else options)
    if not ca:
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=_read(ca, "CA certificate"))
    return grpc.secure_channel(address, credentials, options=options)


def add_port(server, address: str, cert: str = "", key: str = "") -> int:
    """Listen on ``address``, with TLS when ``cert`` and ``key`` (PEM files) are given.

    Returns the bound port; raises OSError when the address cannot be used.
    """
    import grpc

    if bool(cert) != bool(key):
        raise ValueError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
    try:
        if cert:
            credentials = grpc.ssl_server_credentials(
                [(_read(key, "private key"), _read(cert, "certificate"))])
            bound = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:  # newer grpcio raises where older ones return 0
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {address}: address in use or not local")
    return bound

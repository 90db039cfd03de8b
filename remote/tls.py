"""Plaintext or TLS, chosen by certificate files, for framed connections
(board protocol v2); remote/client/grpc_layer.py makes gRPC channels the same way.

Tracker, device server and clients all make their TLS contexts here, so
that TLS is switched on the same way everywhere: a server gets a certificate
and its key (``--tls-cert``/``--tls-key`` or ``TETHER_TLS_CERT``/``TETHER_TLS_KEY``),
a client gets the certificate to trust (``tls_ca=`` / ``--tls-ca`` or
``TETHER_TLS_CA``). With none of them set, traffic is plaintext.

    >>> server_context() is None                  # plaintext without a certificate
    True
"""
from __future__ import annotations

import os
import ssl
from typing import Optional

from remote.defaults import TLS_CA_ENV


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
    # gRPC clients insist on HTTP/2 by ALPN; frame speakers offer none.
    context.set_alpn_protocols(["h2"])
    return context


def client_context(ca: str) -> Optional[ssl.SSLContext]:
    """The TLS context that trusts the PEM file ``ca``, or None for plaintext."""
    if not ca:
        return None
    _read(ca, "CA certificate")
    return ssl.create_default_context(cafile=ca)

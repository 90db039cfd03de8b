"""Just enough HTTP/2 to refuse a gRPC call with a message a person can act on.

A protocol v1 client speaks gRPC where a board now speaks frames (protocol
v2). Closing the connection would leave it with "connection reset" and
retries; instead the board answers every call the client makes with a gRPC
status (FAILED_PRECONDITION) and a message naming both versions. That needs
the HTTP/2 connection preface, SETTINGS and one HEADERS frame per call,
encoded with HPACK's literal forms (RFC 7540, RFC 7541) — no library.
"""
from __future__ import annotations

import socket
import struct
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HEADERS, _SETTINGS, _GOAWAY = 0x1, 0x4, 0x7
_END_STREAM, _END_HEADERS, _ACK = 0x1, 0x4, 0x1
FAILED_PRECONDITION = 9


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _integer(value: int, prefix_bits: int = 7) -> bytes:
    """HPACK integer with a ``prefix_bits`` prefix (RFC 7541, 5.1)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([value])
    out = [limit]
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _literal(name: str, value: str) -> bytes:
    """A header field as a literal without indexing, new name (RFC 7541, 6.2.2)."""
    n, v = name.encode(), value.encode("ascii", "replace")
    return b"\x00" + _integer(len(n)) + n + _integer(len(v)) + v


def grpc_error_headers(status: int, message: str) -> bytes:
    """The header block of a trailers-only gRPC response."""
    text = "".join(c if 0x20 <= ord(c) < 0x7f and c != "%" else f"%{ord(c):02X}"
                   for c in message)
    return (b"\x88"  # :status 200 (static table index 8)
            + _literal("content-type", "application/grpc")
            + _literal("grpc-status", str(status))
            + _literal("grpc-message", text))


def refuse_grpc(sock: socket.socket, seen: bytes, message: str, linger_s: float = 5.0) -> None:
    """Answer each call on this HTTP/2 connection with FAILED_PRECONDITION and
    ``message``; ``seen`` holds the bytes already read from it."""
    buffer = bytearray(seen)
    deadline = time.monotonic() + linger_s

    def need(count: int) -> bool:
        while len(buffer) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            sock.settimeout(left)
            data = sock.recv(65536)
            if not data:
                return False
            buffer.extend(data)
        return True

    if not need(len(PREFACE)) or bytes(buffer[:len(PREFACE)]) != PREFACE:
        return
    del buffer[:len(PREFACE)]
    sock.sendall(_frame(_SETTINGS, 0, 0))
    block = grpc_error_headers(FAILED_PRECONDITION, message)
    answered = 0
    while need(9):
        length = int.from_bytes(buffer[:3], "big")
        kind, flags = buffer[3], buffer[4]
        stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
        if not need(9 + length):
            break
        del buffer[:9 + length]
        if kind == _SETTINGS and not flags & _ACK:
            sock.sendall(_frame(_SETTINGS, _ACK, 0))
        elif kind == _HEADERS and stream:
            sock.sendall(_frame(_HEADERS, _END_STREAM | _END_HEADERS, stream, block))
            answered = stream
    sock.sendall(_frame(_GOAWAY, 0, 0, struct.pack(">II", answered, 0)))

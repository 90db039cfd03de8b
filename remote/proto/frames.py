"""Frames of board protocol v2 (docs/protocol.md, docs/sessions.md).

A frame is ``<u32 header length><u64 body length>``, a ``DataFrame`` message,
then the body as raw bytes. Bulk data never goes through protobuf: a tensor or
a file chunk is written from, and read into, its final buffer.

    >>> a, b = socket.socketpair()                         # doctest: +SKIP
    >>> FrameSocket(a).send(pb.DataFrame(op="ping"))       # doctest: +SKIP
    >>> FrameSocket(b).recv_header().op                    # doctest: +SKIP
    'ping'
"""
from __future__ import annotations

import mmap
import os
import socket
import ssl
import struct
import sys
import time

from remote.defaults import POLL_US_ENV
from remote.proto import pb

PROTOCOL_VERSION = 2
PREFIX = struct.Struct("<IQ")
# The plain answer to a call that returns nothing: a DataFrame with op "ok"
# and nothing else (the tracker's pings are answered with the same bytes).
OK_FRAME = PREFIX.pack(4, 0) + b"\x0a\x02ok"
_OK_PREFIX = OK_FRAME[:PREFIX.size]
# Frames up to this size go out in one sendall (one syscall, one TCP segment
# train); larger bodies are sent from their own buffers without joining.
JOIN_LIMIT = 256 * 1024
MAX_HEADER_BYTES = 16 * 1024 * 1024
# 1 MiB chunks: large enough that per-message overhead vanishes, small enough
# that neither side holds more than a few of them in memory.
CHUNK_BYTES = 1 << 20
READ_BUFFER = 64 * 1024
# struct timeval is two C longs where they are 64-bit; 32-bit boards may use a
# 64-bit time_t with 32-bit longs, so they keep Python's own socket timeouts.
_KERNEL_TIMEOUTS = (struct.calcsize("l") == 8 and hasattr(socket, "SO_RCVTIMEO")
                    and sys.platform.startswith("linux"))
# How long a reader polls for the next frame header before it sleeps in the
# kernel (docs/sessions.md, "Small calls"). Waking a sleeping thread costs more
# than a small call itself; with one core, polling would only hold the CPU the
# other end needs, so it is off there.
def _poll_seconds() -> float:
    text = os.environ.get(POLL_US_ENV, "100")
    try:
        micros = float(text)
    except ValueError:
        raise ValueError(f"{POLL_US_ENV}={text!r} is not a number of microseconds; "
                         "unset it, or give e.g. 100 (0 turns polling off)") from None
    return max(micros, 0.0) * 1e-6 if (os.cpu_count() or 1) > 1 else 0.0


SPIN_SECONDS = _poll_seconds()
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)


class Checksum:
    """A checksum of a transfer, built piece by piece ("fsum64").

    The stream is cut into CHUNK_BYTES blocks (the last may be shorter) and
    each block into little-endian 64-bit words (the last zero-padded). Per
    block, s = sum of its words mod 2**64; over the blocks, A = sum of s and
    B = sum of the running A (Fletcher's scheme, so a block moved, repeated or
    lost changes B); X = xor of every word; and the length in bytes. Any
    single changed bit, a truncation, and a chunk landing in the wrong place
    all change the text.

    It is a check against transfer and buffer-handling faults, not tampering
    (TLS covers that). numpy reduces a block at tens of GB/s where zlib's
    CRC-32 manages 2-3: at 1 GB/s a CRC would take nearly half of each
    end's time (docs/sessions.md). Pieces may have any size:

        >>> a, b = Checksum(), Checksum()
        >>> a.update(b"x" * 3000001); b.update(b"x" * 5); b.update(b"x" * 2999996)
        >>> a.text() == b.text()
        True
    """

    name = "fsum64"

    def __init__(self):
        self._a = self._b = self._x = 0
        self._block_sum = 0   # words of the current block so far
        self._block_fill = 0  # bytes of the current block so far
        self._tail = b""      # bytes of a word cut by the end of a piece
        self._length = 0

    def update(self, data) -> None:
        view = byte_view(data)
        self._length += view.nbytes
        while view.nbytes:
            n = min(view.nbytes, CHUNK_BYTES - self._block_fill)
            self._add(view[:n])
            self._block_fill += n
            view = view[n:]
            if self._block_fill == CHUNK_BYTES:
                self._a, self._b = self._close_block()
                self._block_sum = self._block_fill = 0

    def _add(self, view: memoryview) -> None:
        import numpy as np

        if self._tail:
            need = 8 - len(self._tail)
            self._tail += bytes(view[:need])
            view = view[need:]
            if len(self._tail) < 8:
                return
            word = int.from_bytes(self._tail, "little")
            self._block_sum += word
            self._x ^= word
            self._tail = b""
        whole = view.nbytes & ~7
        if whole:
            words = np.frombuffer(view[:whole], dtype="<u8")
            self._block_sum += int(np.add.reduce(words))  # wraps mod 2**64
            self._x ^= int(np.bitwise_xor.reduce(words))
        if whole < view.nbytes:
            self._tail = bytes(view[whole:])

    def _close_block(self):
        """(A, B) with the current block counted; the state is left as it was."""
        word = int.from_bytes(self._tail.ljust(8, b"\0"), "little") if self._tail else 0
        a = (self._a + self._block_sum + word) & _MASK64
        return a, (self._b + a) & _MASK64

    def text(self) -> str:
        a, b = self._close_block() if self._block_fill else (self._a, self._b)
        x = self._x
        if self._tail:
            x ^= int.from_bytes(self._tail.ljust(8, b"\0"), "little")
        return f"{self.name}:{a:016x}{b:016x}{x:016x}:{self._length}"


_MASK64 = (1 << 64) - 1


class PeerClosed(ConnectionError):
    """The other end closed the connection (or its process died)."""


class NotFrames(ConnectionError):
    """The peer sent something that is not a frame; ``seen`` holds its first bytes."""

    def __init__(self, message: str, seen: bytes):
        super().__init__(message)
        self.seen = seen


def looks_like_http2(exc: BaseException) -> bool:
    """Whether the peer behind ``exc`` speaks HTTP/2, that is gRPC: a protocol
    v1 client (its preface) or a v1 server (a SETTINGS frame first)."""
    seen = getattr(exc, "seen", b"")
    return seen.startswith(b"PRI ") or (len(seen) >= 9 and seen[3] == 4 and seen[5:9] == b"\0" * 4)


def version_error(version: int, who: str) -> str:
    """The message for a first frame of another protocol version."""
    named = f"protocol v{version}" if version else "an older protocol (v1)"
    return (f"this peer speaks Tether board protocol v{PROTOCOL_VERSION} and the {who} "
            f"{named}; run the same Tether version on both ends")


def splice(a: socket.socket, b: socket.socket, name: str, on_done=None) -> None:
    """Carry bytes both ways between two connected sockets, in two threads.

    When one side ends, the other's sending half is shut, and both are
    closed once both directions are done (then ``on_done()`` runs, if given).
    """
    import threading

    done = []
    lock = threading.Lock()

    def pump(src, dst):
        buffer = memoryview(bytearray(CHUNK_BYTES))
        try:
            while True:
                n = src.recv_into(buffer)
                if not n:
                    break
                dst.sendall(buffer[:n])
        except OSError:
            pass
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except (OSError, ValueError):
                pass
        with lock:
            done.append(src)
            last = len(done) == 2
        if last:
            a.close()
            b.close()
            if on_done is not None:
                on_done()

    for src, dst in ((a, b), (b, a)):
        threading.Thread(target=pump, args=(src, dst), name=f"{name}-pump", daemon=True).start()


class PollGate:
    """Whether a reader's next wait polls before it blocks, decided by how
    its recent polls went (docs/sessions.md, "Small calls").

    A poll is a *hit* when the data came within the window with the reader
    running throughout; a *miss* when the window ran out; *preempted* when
    the reader lost its core during the poll (two tries further apart than a
    quarter of the window: a try takes microseconds). On busy cores polling
    holds a core the peer wants, so after a miss or preemption the next
    ``pause`` waits block at once; each bad poll in a row doubles the pause
    (up to MAX_PAUSE waits), a hit resets it. ``stats`` counts each outcome,
    and ``skipped`` the waits that blocked at once because of a pause.
    """

    MAX_PAUSE = 64

    def __init__(self):
        self.pause_left = 0
        self.next_pause = 1
        self.stats = {"hits": 0, "misses": 0, "preempted": 0, "skipped": 0}

    @property
    def polling(self) -> bool:
        """Whether the next wait may poll."""
        return self.pause_left == 0

    def take_turn(self) -> bool:
        """Called before a wait that would poll: False when it must block."""
        if self.pause_left:
            self.pause_left -= 1
            self.stats["skipped"] += 1
            return False
        return True

    def summary(self) -> str:
        """The counters as the servers log them when a session ends."""
        return "polling: {hits} hits, {misses} misses, {preempted} preempted, {skipped} skipped".format(
            **self.stats)

    def record(self, outcome: str) -> None:
        """After a poll: "hits", "misses" or "preempted"."""
        self.stats[outcome] += 1
        if outcome == "hits":
            self.next_pause = 1
        else:
            self.pause_left = self.next_pause
            self.next_pause = min(self.next_pause * 2, self.MAX_PAUSE)


class FrameSocket:
    """A connected socket that speaks frames."""

    def __init__(self, sock: socket.socket, spin: float = SPIN_SECONDS):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Small calls are one segment each way; Nagle would hold them back.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.max_header = MAX_HEADER_BYTES
        # TLS sockets take no recv flags; neither polls without them.
        self.spin = spin if _DONTWAIT and not isinstance(sock, ssl.SSLSocket) else 0.0
        # Whether the last frame came within the polling window: only then
        # does the next read poll first (see _recv_some).
        self.back_to_back = True
        self.poll_gate = PollGate()
        self.body_left = 0
        # Small frames arrive whole in one recv; what it read past the frame
        # waits here for the next read.
        self._buffer = bytearray(READ_BUFFER)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0

    # ---------------------------------------------------------------- send --
    def send(self, header, body=()) -> None:
        """Send ``header`` with ``body`` (a sequence of buffers) as one frame."""
        head = header.SerializeToString()
        if not body:
            self.sock.sendall(PREFIX.pack(len(head), 0) + head)
            return
        views = [byte_view(b) for b in body]
        size = sum(v.nbytes for v in views)
        prefix = PREFIX.pack(len(head), size)
        if size <= JOIN_LIMIT:
            self.sock.sendall(b"".join([prefix, head, *views]))
        else:
            self.sock.sendall(prefix + head)
            for v in views:
                self.sock.sendall(v)

    def set_timeout(self, seconds) -> None:
        """Limit each send and receive to ``seconds`` (None: no limit).

        A timeout on a Python socket adds a poll() before every recv and send;
        the kernel's own SO_RCVTIMEO/SO_SNDTIMEO cost nothing per call. An
        expired limit raises BlockingIOError.
        """
        if _KERNEL_TIMEOUTS:
            whole = 0 if seconds is None else int(seconds)
            micro = 0 if seconds is None else max(int((seconds - whole) * 1e6), 1)
            value = struct.pack("ll", whole, micro)
            self.sock.settimeout(None)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        else:
            self.sock.settimeout(seconds)

    def send_prefix(self, header, body_size: int) -> None:
        """Start a frame whose body the caller sends with ``send_raw``."""
        head = header.SerializeToString()
        self.sock.sendall(PREFIX.pack(len(head), body_size) + head)

    def send_raw(self, data) -> None:
        self.sock.sendall(data)

    def send_file(self, file, offset: int, count: int) -> int:
        """Send ``count`` bytes of an open binary file from ``offset`` with
        sendfile(2) (plain sockets; over TLS the bytes go through the TLS
        layer); returns the bytes sent, fewer if the file ended first."""
        return self.sock.sendfile(file, offset, count)

    # ---------------------------------------------------------------- recv --
    def recv_header(self):
        """Read the next frame's header; its body (``body_left`` bytes) follows."""
        if self.body_left:
            self.skip(self.body_left)
        if self._end - self._start < PREFIX.size:
            self._fill(PREFIX.size)
        start = self._start
        head_len, body_left = PREFIX.unpack_from(self._buffer, start)
        if head_len > self.max_header:
            self._start = start + PREFIX.size
            raise NotFrames(f"frame header of {head_len} bytes; the peer does not speak "
                            "Tether board protocol v2", bytes(self._view[start:start + PREFIX.size]))
        self.body_left = body_left
        end = start + PREFIX.size + head_len
        if end <= self._end:  # a small reply arrives whole with its prefix: no second read
            head = bytes(self._view[start + PREFIX.size:end])
            self._start = end
        elif head_len <= READ_BUFFER - PREFIX.size:
            self._fill(PREFIX.size + head_len)
            start = self._start
            head = bytes(self._view[start + PREFIX.size:start + PREFIX.size + head_len])
            self._start = start + PREFIX.size + head_len
        else:
            self._start = start + PREFIX.size
            buffer = bytearray(head_len)
            self._read_into(memoryview(buffer))
            head = bytes(buffer)
        try:
            return pb.DataFrame.FromString(head)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError differs by version
            raise NotFrames("a frame header that is not a DataFrame message; the peer does "
                            "not speak Tether board protocol v2",
                            PREFIX.pack(head_len, body_left) + head[:64]) from None

    def take_ok(self) -> bool:
        """Read the next frame if it is the plain ``ok`` frame (OK_FRAME) and
        say so; anything else stays for ``recv_header``. A small call's answer
        is then checked without building a message."""
        if self.body_left:
            self.skip(self.body_left)
        if self._end - self._start < PREFIX.size:
            self._fill(PREFIX.size)
        if not self._buffer.startswith(_OK_PREFIX, self._start):
            return False
        if self._end - self._start < len(OK_FRAME):
            self._fill(len(OK_FRAME))  # the prefix promises these bytes
        if not self._buffer.startswith(OK_FRAME, self._start):
            return False
        self._start += len(OK_FRAME)
        return True

    def buffered(self) -> bytes:
        """Bytes received and not yet read as frames."""
        return bytes(self._view[self._start:self._end])

    def _fill(self, count: int) -> None:
        """Receive until ``count`` (at most READ_BUFFER) bytes are buffered."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start:
            left = self._end - self._start
            self._buffer[:left] = self._view[self._start:self._end]
            self._start, self._end = 0, left
        while self._end < count:
            n = self._recv_some()
            if n == 0:
                raise PeerClosed("the connection was closed by the other end")
            self._end += n

    def _recv_some(self) -> int:
        """Read what has arrived into the free end of the read buffer.

        With ``spin``, while frames arrive back to back (each within that
        long of the reader starting to wait), first poll without blocking for
        up to that long: a reply that arrives within microseconds is then
        picked up without the thread going to sleep and being woken, which
        costs more than the call. Once a frame takes longer, the reader
        blocks at once until frames come back to back again, so a reader
        whose calls are far apart, or whose peer is idle, burns no CPU
        polling. ``poll_gate`` also pauses polling after polls that ran out
        or lost the core (busy cores). Only where the socket has no
        Python-level timeout (that would poll() before every recv).
        """
        view = self._view[self._end:]
        if not self.spin or self.sock.gettimeout() is not None:
            return self.sock.recv_into(view)
        if self.back_to_back and self.poll_gate.take_turn():
            n = self._poll(view)
            if n is not None:
                return n
        self.back_to_back = False
        start = time.monotonic()
        n = self.sock.recv_into(view)
        self.back_to_back = time.monotonic() - start <= self.spin
        return n

    def _poll(self, view):
        """Non-blocking reads for up to ``spin``: what one read returned, or
        None when the window ran out. The gate hears how it went."""
        recv_into = self.sock.recv_into
        gap = self.spin / 4
        deadline = last = 0.0
        preempted = False
        while True:
            try:
                n = recv_into(view, 0, _DONTWAIT)
            except BlockingIOError:
                # No sched_yield between tries: on a busy machine it
                # handed the core to another program for a time slice.
                now = time.monotonic()
                if not deadline:
                    deadline = now + self.spin
                elif now - last > gap:
                    preempted = True
                last = now
                if now > deadline:
                    self.poll_gate.record("preempted" if preempted else "misses")
                    return None
                continue
            self.poll_gate.record("preempted" if preempted else "hits")
            return n

    def recv_body_into(self, buffer) -> None:
        view = byte_view(buffer)
        if view.nbytes > self.body_left:
            raise ConnectionError(f"frame body has {self.body_left} bytes left, "
                                  f"{view.nbytes} expected")
        self._read_into(view)
        self.body_left -= view.nbytes

    def recv_body(self) -> bytes:
        data = bytearray(self.body_left)
        self.recv_body_into(data)
        return bytes(data)

    def skip(self, count: int) -> None:
        scratch = page_buffer(min(count, CHUNK_BYTES))
        while count:
            n = min(count, len(scratch))
            self._read_into(scratch[:n])
            count -= n
            self.body_left -= n

    def _read_into(self, view: memoryview) -> None:
        buffered = self._end - self._start
        if buffered:
            n = min(buffered, view.nbytes)
            view[:n] = self._view[self._start:self._start + n]
            self._start += n
            view = view[n:]
        recv_into = self.sock.recv_into
        while view.nbytes:
            n = recv_into(view)
            if n == 0:
                raise PeerClosed("the connection was closed by the other end")
            view = view[n:]

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def frame_bytes(header) -> bytes:
    """A whole body-less frame, for replies and requests sent over and over."""
    head = header.SerializeToString()
    return PREFIX.pack(len(head), 0) + head


def error_frame(error_class: str, message: str):
    return pb.DataFrame(op="error", error=error_class, text=message)


def tensor_header(name: str, array, dtype: str = ""):
    """A Tensor message describing ``array`` (data travels in the frame body),
    as ``dtype`` where given: a module's bfloat16 output is held in uint16
    where numpy has no bfloat16 (minirt.module.numpy_dtype)."""
    return pb.Tensor(name=name, dtype=dtype or array.dtype.name, shape=list(array.shape))


# Tensors carry plain numbers only: booleans, integers, floats, complex. Object,
# string and structured dtypes would turn bytes from the wire into pointers.
TENSOR_KINDS = "biufc"


# The number types numpy lacks and the unsigned type of their bit patterns
# (minirt.module.BIT_PATTERNS): bfloat16, and the low-bit types a byte each.
BIT_PATTERNS = {"bfloat16": "uint16", **{text: "uint8" for text in (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn",
    "int4", "uint4", "int2", "uint2")}}


def tensor_dtype(name: str, text: str):
    """The little-endian numpy dtype a Tensor message names, or ValueError."""
    import numpy as np

    if text in BIT_PATTERNS:
        # numpy knows these once ml_dtypes is imported; elsewhere their bit
        # patterns travel as unsigned integers (minirt.module.numpy_dtype)
        try:
            return np.dtype(text).newbyteorder("<")
        except TypeError:
            return np.dtype(BIT_PATTERNS[text]).newbyteorder("<")
    try:
        dtype = np.dtype(text)
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in TENSOR_KINDS or dtype.fields or dtype.subdtype:
        raise ValueError(f"tensor {name!r} has dtype {text!r}; tensors hold numbers only "
                         "(bool, int8-64, uint8-64, bfloat16, float16/32/64, float8, float4, int4, "
                         "int2, complex)")
    return dtype.newbyteorder("<")


def recv_tensors(fs: FrameSocket, descs) -> list:
    """Read the body of a frame as one new numpy array per Tensor description."""
    arrays = []
    for desc in descs:
        dtype = tensor_dtype(desc.name, desc.dtype)
        nbytes = tensor_bytes(desc.name, desc.shape, dtype)
        if nbytes > fs.body_left:
            raise ValueError(f"tensor {desc.name!r} of shape {tuple(desc.shape)} {dtype.name} "
                             f"needs {nbytes} bytes, the frame has {fs.body_left} left")
        array = aligned_empty(tuple(desc.shape), dtype)
        fs.recv_body_into(array)
        arrays.append(array.astype(dtype.newbyteorder("="), copy=False))
    if fs.body_left:
        raise ValueError(f"{fs.body_left} bytes of tensor data left over after "
                         f"{len(arrays)} tensor(s)")
    return arrays


def tensor_bytes(name: str, shape, dtype) -> int:
    """The bytes a tensor of ``shape`` takes, counted before anything is
    allocated for it (a shape from the wire may be absurd)."""
    count = 1
    for d in shape:
        if d < 0:
            raise ValueError(f"tensor {name!r} has a negative dimension {list(shape)}")
        count *= d
    return count * dtype.itemsize


def page_buffer(size: int) -> memoryview:
    """A writable buffer of ``size`` bytes that starts on a page boundary.

    The kernel copies socket and file data with ``rep movsb``, which on the
    AMD host these figures come from ran at about two thirds of its speed
    into or out of a buffer 16 bytes off a page boundary, where malloc puts
    large blocks (a bytearray's, a numpy array's).
    """
    return memoryview(mmap.mmap(-1, max(size, 1)))[:size]


def aligned_empty(shape, dtype):
    """``np.empty(shape, dtype)`` whose data starts on a page boundary
    (see ``page_buffer``); small arrays are allocated as usual."""
    import numpy as np

    dtype = np.dtype(dtype)
    count = 1
    for d in shape:
        count *= d
    nbytes = count * dtype.itemsize
    if nbytes < _ALIGN_FROM:
        return np.empty(shape, dtype)
    raw = np.empty(nbytes + _PAGE, np.uint8)
    offset = -raw.ctypes.data % _PAGE
    return raw[offset:offset + nbytes].view(dtype).reshape(shape)


_PAGE = mmap.PAGESIZE
_ALIGN_FROM = 64 * 1024


def send_file_chunks(fs: FrameSocket, file, total: int, progress=None):
    """Send the first ``total`` bytes of an open binary file in chunks with
    sendfile(2), after a prefix; returns the checksum, or None when the file
    turned out shorter. The frame's body is whole either way (a shorter file
    is followed by zeros), so the connection stays in step; the caller then
    sends an ``end`` whose checksum cannot match, and the far end discards it.

    The kernel hands the file's cached pages to the socket, where sending
    a buffer copied every byte once more; the checksum reads each chunk into
    one page-aligned buffer with pread. (Not through a mapping of the file:
    a file cut short by another process while mapped kills the reader with
    SIGBUS, and here the reader is the user's program.)
    """
    checksum = Checksum()
    buffer = page_buffer(min(CHUNK_BYTES, max(total, 1)))
    for done in range(0, total, CHUNK_BYTES):
        n = min(CHUNK_BYTES, total - done)
        view = buffer[:n]
        if os.preadv(file.fileno(), [view], done) != n:
            _send_zeros(fs, total - done)
            return None
        checksum.update(view)
        sent = fs.send_file(file, done, n)
        if sent != n:
            _send_zeros(fs, total - done - sent)
            return None
        if progress is not None:
            progress(done + n, total)
    return checksum.text()


# What an ``end`` frame carries after a body that a shrinking file cut short.
CUT_SHORT = "cut short at the sender"


def _send_zeros(fs: FrameSocket, count: int) -> None:
    zeros = memoryview(bytes(min(CHUNK_BYTES, count)))
    while count > 0:
        step = min(count, len(zeros))
        fs.send_raw(zeros[:step])
        count -= step


def send_array_chunks(fs: FrameSocket, array, progress=None) -> str:
    """Send a contiguous array's bytes in chunks (after a prefix); returns the checksum."""
    checksum = Checksum()
    total = array.nbytes
    flat = byte_view(array)
    for i in range(0, total, CHUNK_BYTES):
        view = flat[i:i + CHUNK_BYTES]
        checksum.update(view)  # while the chunk is still in the cache
        fs.send_raw(view)
        if progress is not None:
            progress(min(i + CHUNK_BYTES, total), total)
    return checksum.text()


def recv_array_chunks(fs: FrameSocket, array, progress=None) -> str:
    """Fill a contiguous array from the frame body in chunks; returns the checksum."""
    checksum = Checksum()
    total = array.nbytes
    flat = byte_view(array)
    for i in range(0, total, CHUNK_BYTES):
        view = flat[i:i + CHUNK_BYTES]
        fs.recv_body_into(view)
        checksum.update(view)
        if progress is not None:
            progress(min(i + CHUNK_BYTES, total), total)
    return checksum.text()


def byte_view(data) -> memoryview:
    """The bytes of a contiguous buffer, as a flat view: of any shape, a
    0-d array's or one with a zero dimension too (which memoryview.cast
    refuses).

    >>> import numpy as np
    >>> byte_view(np.zeros((0, 3), np.float32)).nbytes, byte_view(np.float32(2).reshape(())).nbytes
    (0, 4)
    """
    try:
        view = memoryview(data)
    except ValueError:  # a dtype the buffer protocol cannot name (ml_dtypes' bfloat16, float8, int4, ...)
        import numpy as np
        view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    if view.nbytes == 0:
        return memoryview(b"")
    return view.cast("B")


def little_endian(array):
    """``array`` as contiguous little-endian data of the same shape (a 0-d
    array stays 0-d), copied only when it must be."""
    import numpy as np

    array = np.asarray(array)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).reshape(array.shape)

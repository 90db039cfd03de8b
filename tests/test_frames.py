"""The data connection's framing and transfer checksum (remote/proto/frames.py)."""
import random
import socket

import numpy as np
import pytest

from remote.proto import pb
from remote.proto.frames import CHUNK_BYTES, Checksum, FrameSocket, frame_bytes

DATA = np.random.default_rng(0).integers(0, 256, 3 * CHUNK_BYTES + 13, dtype=np.uint8).tobytes()


def checksum(*pieces) -> str:
    c = Checksum()
    for piece in pieces:
        c.update(piece)
    return c.text()


def test_checksum_does_not_depend_on_how_the_stream_is_cut():
    whole = checksum(DATA)
    rng = random.Random(1)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(DATA)), rng.randint(1, 9)))
        bounds = [0, *cuts, len(DATA)]
        assert checksum(*(DATA[a:b] for a, b in zip(bounds, bounds[1:]))) == whole
    assert checksum(memoryview(DATA)[:5], np.frombuffer(DATA[5:], np.uint8)) == whole


@pytest.mark.parametrize("fault", ["bit", "swapped chunks", "repeated chunk", "truncated",
                                   "zero byte dropped", "words swapped"])
def test_checksum_changes_for_each_transfer_fault(fault):
    data = bytearray(DATA[:-13] + b"\0" * 13)
    if fault == "bit":
        data[CHUNK_BYTES + 12345] ^= 0x10
    elif fault == "swapped chunks":
        data[:2 * CHUNK_BYTES] = data[CHUNK_BYTES:2 * CHUNK_BYTES] + data[:CHUNK_BYTES]
    elif fault == "repeated chunk":
        data[CHUNK_BYTES:2 * CHUNK_BYTES] = data[:CHUNK_BYTES]
    elif fault == "truncated":
        del data[2 * CHUNK_BYTES:]
    elif fault == "zero byte dropped":
        del data[-1]
    elif fault == "words swapped":  # the same words, xor and sum alike, in another chunk
        a, b = slice(8, 16), slice(CHUNK_BYTES + 8, CHUNK_BYTES + 16)
        assert data[a] != data[b]
        data[a], data[b] = data[b], data[a]
    assert checksum(bytes(data)) != checksum(DATA[:-13] + b"\0" * 13)


def test_empty_and_tiny_streams_have_distinct_checksums():
    texts = {checksum(b""), checksum(b"\0"), checksum(b"\0\0"), checksum(b"\1")}
    assert len(texts) == 4


def test_frames_cross_a_socket_with_polling_reader():
    a, b = socket.socketpair()
    sender, reader = FrameSocket(a), FrameSocket(b, spin=0.001)
    assert reader.spin == 0.001
    sender.send_raw(frame_bytes(pb.DataFrame(op="ping")))
    sender.send(pb.DataFrame(op="upload", name="x"), [b"abc", b"def"])
    assert reader.recv_header().op == "ping"
    header = reader.recv_header()
    assert (header.op, header.name, reader.body_left) == ("upload", "x", 6)
    assert reader.recv_body() == b"abcdef"
    a.close()
    with pytest.raises(ConnectionError):
        reader.recv_header()
    b.close()


def test_a_bad_poll_setting_is_named_with_what_to_do():
    import os
    import subprocess
    import sys
    env = {**os.environ, "TETHER_POLL_US": "fast"}
    out = subprocess.run([sys.executable, "-c", "import remote.proto.frames"], env=env,
                         capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode != 0
    assert "TETHER_POLL_US='fast' is not a number of microseconds" in out.stderr
    assert "0 turns polling off" in out.stderr

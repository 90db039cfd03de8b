"""Many simulated boards in one process, speaking the real board-link protocol.

    python benchmarks/board_sim.py --tracker 127.0.0.1:9190 --boards 10000 --key sim

Each simulated board opens its own link to the tracker (one TCP connection),
registers as a relayed board with its capabilities, pings at the interval
the tracker asks for, and answers nothing else: what a tracker holds for a
farm of idle boards. It prints ``registered N`` once all are registered and
``pings P`` every few seconds, and runs until stopped.

The boards stand for machines of their own, so the simulator spends as little
of the tracker's host as it can: no event loop and no protobuf after
registration. The boards' pings are spread evenly over the interval, one
slice of boards every few milliseconds, and before each slice pings, the
links the tracker wrote to (its pongs, relay requests left unanswered) are
read. A board whose link the tracker closes is counted as dropped.
"""
from __future__ import annotations

import argparse
import os
import resource
import select
import selectors
import socket
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from remote.address import split_address  # noqa: E402
from remote.proto import pb  # noqa: E402
from remote.proto.frames import PREFIX, PROTOCOL_VERSION, frame_bytes  # noqa: E402

BATCH = 500        # boards registering at once, as a farm's boards come up over a few seconds
SLICES = 200       # groups of boards pinging at different moments within each interval


def register_batch(host: str, port: int, key: str, first: int, count: int,
                   secret: str) -> tuple:
    """Register boards ``first``..``first + count - 1``; their sockets and the ping interval."""
    selector = selectors.DefaultSelector()
    replies = []
    for index in range(first, first + count):
        sock = socket.create_connection((host, port))
        info = pb.DeviceInfo(triple="aarch64-unknown-linux-gnu", machine="aarch64", cores=4,
                             cpu_model="simulated Cortex-A72", attributes={"sim": str(index)})
        sock.sendall(frame_bytes(pb.DataFrame(op="register", version=PROTOCOL_VERSION,
                                              key=key, info=info, relay=True,
                                              farm_secret=secret)))
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, bytearray())
    interval = 1.0
    while len(replies) < count:
        ready = selector.select(30)
        if not ready:
            raise SystemExit(f"the tracker left {count - len(replies)} registrations "
                             "unanswered for 30 s")
        for selected, _ in ready:
            sock, data = selected.fileobj, selected.data
            chunk = sock.recv(65536)
            if not chunk:
                raise SystemExit("the tracker closed a link before answering its registration")
            data += chunk
            if len(data) < PREFIX.size:
                continue
            head_len, body_len = PREFIX.unpack_from(data)
            if len(data) < PREFIX.size + head_len + body_len:
                continue
            reply = pb.DataFrame.FromString(bytes(data[PREFIX.size:PREFIX.size + head_len]))
            if reply.op != "ok":
                raise SystemExit(f"a board was refused: {reply.text}")
            interval = reply.seconds or 1.0
            selector.unregister(sock)
            replies.append(sock)
    selector.close()
    return replies, interval


class Pinger:
    """Pings every board it holds once per interval, a slice of them at a time."""

    def __init__(self):
        self.slices = [[] for _ in range(SLICES)]
        self.count = 0
        self.interval = 1.0
        self.report = False  # "pings P" lines only after "registered N"
        self.poll = select.epoll()
        self.by_fd = {}

    def add(self, socks: list, interval: float) -> None:
        self.interval = interval
        for sock in socks:
            self.by_fd[sock.fileno()] = sock
            self.poll.register(sock.fileno(), select.EPOLLIN)
            self.slices[self.count % SLICES].append(sock)
            self.count += 1

    def forget(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        if fd >= 0 and self.by_fd.get(fd) is sock:
            del self.by_fd[fd]
            self.poll.unregister(fd)
        sock.close()

    def run(self) -> None:
        ping = frame_bytes(pb.DataFrame(op="ping"))
        scratch = bytearray(65536)
        pings = dropped = 0
        next_report = time.monotonic() + 2.0
        due = time.monotonic()
        while True:
            for group in self.slices:
                due += self.interval / SLICES
                # Only the links the tracker wrote to are read (its pongs come
                # once in a few pings); a closed link reads as end of file.
                for fd, _ in self.poll.poll(0):
                    sock = self.by_fd.get(fd)
                    if sock is None:
                        continue
                    try:
                        n = len(scratch)
                        while n == len(scratch):
                            n = sock.recv_into(scratch)
                        if n == 0:
                            self.forget(sock)  # its next ping fails: counted dropped
                    except BlockingIOError:
                        pass
                    except OSError:
                        self.forget(sock)
                for i, sock in enumerate(group):
                    if sock is None:
                        continue
                    try:
                        sock.send(ping)
                        pings += 1
                        continue
                    except OSError:
                        pass
                    group[i] = None
                    self.forget(sock)
                    dropped += 1
                now = time.monotonic()
                if self.report and now >= next_report:
                    print(f"pings {pings}" + (f" dropped {dropped}" if dropped else ""),
                          flush=True)
                    next_report = now + 2.0
                if due > now:
                    time.sleep(due - now)
                elif due < now - self.interval:
                    due = now  # fell behind (registering takes the CPU): no burst to catch up


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracker", required=True)
    parser.add_argument("--boards", type=int, default=1000)
    parser.add_argument("--key", default="sim")
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.boards + 1000)), hard))
    host, port = split_address(args.tracker, 9190)
    secret = os.environ.get("TETHER_FARM_SECRET", "")
    pinger = Pinger()
    # Boards registered so far ping while the rest register.
    threading.Thread(target=pinger.run, daemon=True).start()
    for first in range(0, args.boards, BATCH):
        pinger.add(*register_batch(host, port, args.key, first,
                                   min(BATCH, args.boards - first), secret))
    print(f"registered {pinger.count}", flush=True)
    pinger.report = True
    threading.Event().wait()


if __name__ == "__main__":
    main()

"""Many simulated boards in one process, speaking the real board-link protocol.

    python benchmarks/board_sim.py --tracker 127.0.0.1:9190 --boards 10000 --key sim

Each simulated board opens its own link to the tracker (one TCP connection),
registers as a relayed board with its capabilities, pings at the interval
the tracker asks for, and answers nothing else: what a tracker holds for a
farm of idle boards. It prints ``registered N`` once all are registered and
``pings P`` every few seconds, and runs until stopped.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from remote.address import split_address  # noqa: E402
from remote.proto import pb  # noqa: E402
from remote.proto.frames import PREFIX, PROTOCOL_VERSION, frame_bytes  # noqa: E402

PINGS = [0]


async def read_frame(reader):
    head_len, body_len = PREFIX.unpack(await reader.readexactly(PREFIX.size))
    frame = pb.DataFrame.FromString(await reader.readexactly(head_len))
    if body_len:
        await reader.readexactly(body_len)
    return frame


async def board(host, port, key, index, registered, secret):
    reader, writer = await asyncio.open_connection(host, port)
    info = pb.DeviceInfo(triple="aarch64-unknown-linux-gnu", machine="aarch64", cores=4,
                         cpu_model="simulated Cortex-A72", attributes={"sim": str(index)})
    writer.write(frame_bytes(pb.DataFrame(op="register", version=PROTOCOL_VERSION, key=key,
                                          info=info, relay=True, farm_secret=secret)))
    reply = await read_frame(reader)
    if reply.op != "ok":
        raise SystemExit(f"board {index} was refused: {reply.text}")
    registered.append(index)
    interval = reply.seconds or 1.0
    ping = frame_bytes(pb.DataFrame(op="ping"))

    async def pinger():
        while True:
            await asyncio.sleep(interval)
            writer.write(ping)
            PINGS[0] += 1

    task = asyncio.ensure_future(pinger())
    try:
        while True:
            await read_frame(reader)  # pongs (and relay requests, left unanswered)
    finally:
        task.cancel()


async def main_async(args):
    host, port = split_address(args.tracker, 9190)
    registered = []
    secret = os.environ.get("TETHER_FARM_SECRET", "")
    tasks = []
    # Registered in batches, as a farm's boards come up over a few seconds.
    for start in range(0, args.boards, 500):
        for i in range(start, min(start + 500, args.boards)):
            tasks.append(asyncio.ensure_future(board(host, port, args.key, i, registered,
                                                     secret)))
        while len(registered) < min(start + 500, args.boards):
            await asyncio.sleep(0.01)
            for t in tasks:
                if t.done() and t.exception():
                    raise t.exception()
    print(f"registered {len(registered)}", flush=True)
    while True:
        await asyncio.sleep(2.0)
        print(f"pings {PINGS[0]}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tracker", required=True)
    parser.add_argument("--boards", type=int, default=1000)
    parser.add_argument("--key", default="sim")
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.boards + 1000)), hard))
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()

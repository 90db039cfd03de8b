"""Adaptive polling for small calls (docs/sessions.md, "Small calls"): a
reader polls for an answer while that pays, and stops for a while after
polls that ran out or lost the core. Checked from the reader's own counters
(FrameSocket.poll_gate), never from times."""
import os
import re
import socket

import pytest

from remote import rpc
from remote.cli.localfarm import Child
from remote.proto import pb
from remote.proto.frames import FrameSocket, PollGate, frame_bytes
from tests import board_servers
from tests.competing_load import CompetingLoad, cores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**{k: v for k, v in os.environ.items() if k != "TETHER_POLL_US"},
       "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture(scope="module", params=board_servers.KINDS)
def kind(request):
    return request.param


@pytest.fixture
def start_server(kind, tmp_path):
    """Starts a server of ``kind`` whose session processes poll for
    ``poll_us`` (TETHER_POLL_US; None: the default window)."""
    children = []

    def start(poll_us=None):
        workspaces = tmp_path / f"workspaces{len(children)}"
        workspaces.mkdir()
        env = ENV if poll_us is None else {**ENV, "TETHER_POLL_US": str(poll_us)}
        child = Child("server", [*board_servers.command(kind), "--host", "127.0.0.1", "--port", "0",
                                 "--workspace-dir", str(workspaces)], str(tmp_path), env)
        children.append(child)
        return child

    yield start
    for child in children:
        child.stop()


def server_polling(server) -> list:
    """Each ended session's counters from the server's log, as dicts."""
    text = server.log_text()
    return [dict(hits=int(m[1]), misses=int(m[2]), preempted=int(m[3]), skipped=int(m[4]))
            for m in re.finditer(r"session \S+ polling: (\d+) hits, (\d+) misses, "
                                 r"(\d+) preempted, (\d+) skipped", text)]


def test_gate_pauses_longer_after_each_bad_poll_and_a_hit_resets_it():
    gate = PollGate()
    assert gate.polling and gate.take_turn()
    gate.record("misses")
    assert not gate.polling
    assert [gate.take_turn() for _ in range(2)] == [False, True]
    gate.record("preempted")  # second bad poll in a row: two waits block at once
    assert [gate.take_turn() for _ in range(3)] == [False, False, True]
    gate.record("hits")
    assert gate.polling
    gate.record("misses")  # after a hit the pause is one wait again
    assert [gate.take_turn() for _ in range(2)] == [False, True]
    for _ in range(20):
        gate.record("misses")
    assert gate.pause_left == PollGate.MAX_PAUSE
    assert gate.stats == {"hits": 1, "misses": 22, "preempted": 1, "skipped": 4}


def test_frames_already_there_count_as_hits():
    a, b = socket.socketpair()
    sender, reader = FrameSocket(a), FrameSocket(b, spin=0.001)
    for _ in range(3):
        sender.send_raw(frame_bytes(pb.DataFrame(op="ping")))
        assert reader.recv_header().op == "ping"
    assert reader.poll_gate.polling
    assert reader.poll_gate.stats == {"hits": 3, "misses": 0, "preempted": 0, "skipped": 0}
    a.close()
    b.close()


def test_polling_stays_on_for_back_to_back_calls(start_server):
    # Windows far longer than any answer takes, on both ends: every poll is
    # a hit unless the reader loses its core for a quarter of a second.
    server = start_server(poll_us=1000000)
    with rpc.connect("127.0.0.1", server.port, timeout=60) as sess:
        sess._data.spin = 1.0
        sess.ping()  # the session's process may still be starting
        sess._data.poll_gate = PollGate()
        for _ in range(200):
            sess.ping()
        gate = sess._data.poll_gate
        assert gate.polling, gate.stats
        assert gate.stats["hits"] >= 200 and gate.stats["misses"] == 0, gate.stats
        assert gate.stats["skipped"] == 0, gate.stats
    # The session's process polls for each next request; it has its
    # counters logged before it answers the close.
    served = server_polling(server)
    assert served, server.log_text()[-2000:]
    assert served[-1]["hits"] >= 200 and served[-1]["misses"] == 0, served
    assert served[-1]["skipped"] == 0, served


def test_polling_switches_off_with_a_spinner_on_every_core(start_server):
    server = start_server()
    with rpc.connect("127.0.0.1", server.port, timeout=60) as sess:
        sess._data.spin = 100e-6
        with CompetingLoad(cores()):
            for _ in range(300):
                sess.ping()
        stats = sess._data.poll_gate.stats
        assert stats["misses"] + stats["preempted"] > 0, stats
        assert stats["skipped"] > 0, stats
    # The session's process waited for the next request on the same busy
    # cores: its polls ran out or lost the core too, and it paused them.
    served = server_polling(server)
    assert served, server.log_text()[-2000:]
    served = served[-1]
    assert served["misses"] + served["preempted"] > 0, served
    assert served["skipped"] > 0, served

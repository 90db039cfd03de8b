"""The tracker with real processes on loopback: queue order, timeouts, eviction,
restarts, leases, filters, the farm secret, TLS and `tether status`."""
import contextlib
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest

from remote import errors, rpc
from remote.cli.localfarm import LocalFarm
from remote.client.session import Session
from remote.proto import pb
from remote.proto.frames import PROTOCOL_VERSION, FrameSocket, frame_bytes
from remote.tracker.boards import PONG_EVERY_S
from tests import board_servers
from tests.cli_processes import wait_for_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Only a hang takes this long: every wait below ends as soon as its state is seen.
HANG_S = 300.0


def child_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TETHER_FARM_SECRET", "TETHER_TLS_CA", "TETHER_TLS_CERT", "TETHER_TLS_KEY")}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.update(extra)
    return env


# The device server the farms below run: every test runs with both kinds.
_COMMAND = []


@pytest.fixture(scope="module", autouse=True, params=board_servers.KINDS)
def kind(request):
    _COMMAND[:] = board_servers.command(request.param)
    return request.param


@contextlib.contextmanager
def local_farm(keys=("k",), tracker_args=(), server_args=(), **env):
    with LocalFarm(keys=list(keys), tracker_args=list(tracker_args),
                   server_args=list(server_args), env=child_env(**env),
                   server_command=_COMMAND) as farm:
        yield farm


def wait_until(condition, what, timeout=HANG_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout} s")


def key_status(tracker, key):
    return {k["key"]: k for k in tracker.summary()["keys"]}.get(
        key, {"total": 0, "free": 0, "pending": 0})


def run_client(farm, code):
    """A client in its own process (so it can be killed); returns the Popen."""
    script = (f"import sys, time\nfrom remote import rpc\n"
              f"tracker = rpc.connect_tracker('127.0.0.1', {farm.tracker[1]})\n{code}")
    return subprocess.Popen([sys.executable, "-c", script], env=farm.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# ------------------------------------------------------------- the queue --

def test_priority_first_then_fifo_and_the_queue_is_visible():
    with local_farm(keys=["k"]) as farm:
        tracker = farm.client()
        served, lock = [], threading.Lock()

        def want(name, priority):
            with tracker.request("k", priority=priority, timeout=HANG_S, client=name):
                with lock:
                    served.append(name)

        holder = tracker.request("k", timeout=HANG_S, client="holder")
        threads = []
        for n, (name, priority) in enumerate([("low-1", 0), ("low-2", 0), ("high", 5), ("low-3", 0)]):
            t = threading.Thread(target=want, args=(name, priority))
            t.start()
            threads.append(t)
            wait_until(lambda: key_status(tracker, "k")["pending"] == n + 1, f"{name} queued")
        summary = tracker.summary()
        assert [(w["client"], w["priority"]) for w in summary["waiting"]] == [
            ("high", 5), ("low-1", 0), ("low-2", 0), ("low-3", 0)]
        assert all(w["waited_s"] > 0 for w in summary["waiting"])
        (device,) = summary["devices"]
        assert (device["state"], device["holder"]) == ("in_use", "holder")
        text = tracker.text_summary()
        assert "high" in text and "holder" in text and device["address"] in text
        holder.close()
        for t in threads:
            t.join(HANG_S)
        assert served == ["high", "low-1", "low-2", "low-3"]
        assert key_status(tracker, "k") == {"key": "k", "total": 1, "free": 1, "pending": 0}


def test_request_timeout_is_typed_and_leaves_the_queue():
    with local_farm(keys=["k"]) as farm:
        tracker = farm.client()
        with tracker.request("k", timeout=HANG_S):
            # The tracker's own message: its timeout ended the wait, not the
            # client's deadline (which the client keeps only for a lost tracker).
            with pytest.raises(errors.RequestTimeout, match="'k'.*0.5 s"):
                tracker.request("k", timeout=0.5)
            assert key_status(tracker, "k")["pending"] == 0


def test_unknown_key_fails_at_once_unless_asked_to_wait():
    with local_farm(keys=["k", "other"]) as farm:
        tracker = farm.client()
        with pytest.raises(errors.NoSuchKey, match=r"'late'.*registered keys: k, other"):
            tracker.request("late", timeout=30)
        got = []
        waiter = threading.Thread(target=lambda: got.append(
            tracker.request("late", wait_for_key=True, timeout=HANG_S)))
        waiter.start()
        wait_until(lambda: key_status(tracker, "late")["pending"] == 1, "request queued")
        farm.add_server("late")
        waiter.join(HANG_S)
        (sess,) = got
        assert sess.listdir() == []
        sess.close()


def test_attribute_filters_pick_the_matching_board():
    with local_farm(keys=[]) as farm:
        farm.add_server("arm", extra=["--attr", "board=rpi3"])
        farm.add_server("arm", extra=["--attr", "board=rpi4"])
        tracker = farm.client()
        for _ in range(3):
            with tracker.request("arm", filters={"board": "rpi4"}, timeout=HANG_S) as sess:
                assert sess.device_info()["attributes"]["board"] == "rpi4"
        with tracker.request("arm", filters={"board": "rpi3"}, timeout=HANG_S) as sess:
            assert sess.device_info()["attributes"]["board"] == "rpi3"
        with pytest.raises(errors.RequestTimeout):
            tracker.request("arm", filters={"board": "rpi5"}, timeout=0.5)


# ----------------------------------------------------------------- leases --

def test_wrong_and_reused_lease_tokens_are_refused():
    with local_farm(keys=["k"]) as farm:
        tracker = farm.client()
        lease = tracker.lease("k", timeout=HANG_S)
        assert len(lease.token) >= 32
        with pytest.raises(errors.AuthenticationError, match="unknown or expired lease"):
            Session(lease.address, lease_token=lease.token[:-4] + "AAAA")
        sess = Session(lease.address, lease_token=lease.token)
        assert key_status(tracker, "k")["free"] == 0
        with pytest.raises(errors.AuthenticationError, match="already used"):
            Session(lease.address, lease_token=lease.token)
        sess.close()
        wait_until(lambda: key_status(tracker, "k")["free"] == 1, "device back in the pool")
        with pytest.raises(errors.AuthenticationError, match="unknown or expired"):
            Session(lease.address, lease_token=lease.token)
        assert key_status(tracker, "k")["free"] == 1


def test_unredeemed_lease_expires_and_device_returns():
    with local_farm(keys=["k"], tracker_args=["--unused-lease-timeout", "1"]) as farm:
        tracker = farm.client()
        lease = tracker.lease("k", timeout=HANG_S)
        # The lease may expire before a summary could show it held (a second is
        # short on a loaded machine): the tracker's log says why the board returned.
        wait_until(lambda: key_status(tracker, "k")["free"] == 1, "unused lease expired")
        assert f"lease on {lease.device_id} expired unused" in farm.tracker_proc.log_text()
        with pytest.raises(errors.AuthenticationError):
            Session(lease.address, lease_token=lease.token)


def test_client_killed_while_waiting_or_holding_frees_queue_and_device():
    # A killed client's connections are closed by its kernel: the device server
    # sees its session's connection end, ends the session and gives the lease back.
    with local_farm(keys=["k"]) as farm:
        tracker = farm.client()
        holder = run_client(farm, "s = tracker.request('k', timeout=300)\n"
                                  "print('holding', flush=True)\ntime.sleep(600)")
        try:
            wait_for_line(holder, lambda line: line.strip() == b"holding", HANG_S,
                          "the holder's 'holding' line")
            waiter = run_client(farm, "tracker.request('k', timeout=600)")
            wait_until(lambda: key_status(tracker, "k")["pending"] == 1, "second client queued")
            waiter.kill()
            waiter.wait()
            wait_until(lambda: key_status(tracker, "k")["pending"] == 0,
                       "killed client's request left the queue")
            (device,) = tracker.summary()["devices"]
            assert device["state"] == "in_use"
            holder.send_signal(signal.SIGKILL)
            holder.wait()
            wait_until(lambda: key_status(tracker, "k")["free"] == 1,
                       "device returned after its holder was killed")
        finally:
            holder.kill()
        with tracker.request("k", timeout=HANG_S) as sess:
            assert sess.listdir() == []


def test_silent_client_session_ends_after_the_idle_timeout():
    # A client that stays connected but says nothing (a laptop that went to
    # sleep) holds the board only until the server's --idle-timeout.
    with local_farm(keys=["k"], server_args=["--idle-timeout", "2"]) as farm:
        tracker = farm.client()
        sess = tracker.request("k", timeout=HANG_S)
        wait_until(lambda: key_status(tracker, "k")["free"] == 1, "idle session ended")
        with pytest.raises(errors.SessionEnded, match="idle for 2 s"):
            sess.ping()
        sess.close()


# --------------------------------------------------------------- liveness --

@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["frozen", "killed"])
def test_silent_server_is_evicted_within_the_window(sig):
    with local_farm(keys=["k", "k"], tracker_args=["--eviction-window", "2"]) as farm:
        tracker = farm.client()
        victim = farm.servers[0]
        victim_address = f"127.0.0.1:{victim.port}"
        assert victim_address in [d["address"] for d in tracker.summary()["devices"]]
        os.kill(victim.proc.pid, sig)
        try:
            wait_until(lambda: victim_address not in
                       [d["address"] for d in tracker.summary()["devices"]], "eviction")
            log = farm.tracker_proc.log_text()
            if sig == signal.SIGSTOP:
                # A frozen board keeps its link open: evicted for its silence,
                # measured by the tracker's own clock.
                silent_s = re.search(rf"at {victim_address}\): silent for ([\d.]+) s", log)
                assert silent_s and float(silent_s.group(1)) >= 2.0, log
            else:
                # A dead board's kernel closes its link: dropped at once.
                assert re.search(r"dropped k-\S+ \(k\): its link to the tracker closed", log), log
            assert key_status(tracker, "k")["total"] == 1
            with tracker.request("k", timeout=HANG_S) as sess:
                assert sess.address != victim_address
            if sig == signal.SIGSTOP:
                os.kill(victim.proc.pid, signal.SIGCONT)
                wait_until(lambda: key_status(tracker, "k")["total"] == 2,
                           "thawed server registered again")
        finally:
            if sig == signal.SIGSTOP:
                os.kill(victim.proc.pid, signal.SIGCONT)


def test_a_link_is_answered_however_its_pings_arrive():
    """Pings as every board sends them, several back to back, split over two
    writes, with an id; then a request on the same link; then the link closes.
    A link's first ping is answered at once, a ping with an id always, the
    others at most once in PONG_EVERY_S and never left unanswered for long."""
    with local_farm(keys=[]) as farm:
        tracker = farm.client()
        link = socket.create_connection(farm.tracker)
        link.settimeout(HANG_S)
        reader = FrameSocket(link)
        link.sendall(frame_bytes(pb.DataFrame(op="register", version=PROTOCOL_VERSION,
                                              key="raw", relay=True)))
        assert reader.recv_header().op == "ok"
        ping = frame_bytes(pb.DataFrame(op="ping"))

        link.sendall(ping)
        first = reader.recv_header()
        assert (first.op, first.id) == ("ok", 0)
        link.sendall(ping * 3)
        link.sendall(ping[:5])
        time.sleep(0.2)
        link.sendall(ping[5:] + ping)
        link.sendall(frame_bytes(pb.DataFrame(op="ping", id=7)))
        frames = [reader.recv_header()]
        while frames[-1].id != 7:
            frames.append(reader.recv_header())
        assert all((f.op, f.id) == ("ok", 0) for f in frames[:-1]), frames
        assert frames[-1].op == "ok"

        # A board pinging every 0.2 s hears from its tracker again.
        link.settimeout(0.2)
        answered = None
        deadline = time.monotonic() + PONG_EVERY_S + HANG_S
        while answered is None and time.monotonic() < deadline:
            link.sendall(ping)
            try:
                answered = reader.recv_header()
            except socket.timeout:
                continue
        assert answered is not None and (answered.op, answered.id) == ("ok", 0)
        link.settimeout(HANG_S)
        link.sendall(frame_bytes(pb.DataFrame(op="redeem", id=8, token="not a lease")))
        refused = reader.recv_header()
        while refused.id != 8:  # a pong still under way
            assert (refused.op, refused.id) == ("ok", 0), refused
            refused = reader.recv_header()
        assert (refused.op, refused.id, refused.error) == ("error", 8, "AuthenticationError")
        assert key_status(tracker, "raw")["total"] == 1
        link.close()
        wait_until(lambda: key_status(tracker, "raw")["total"] == 0, "closed link dropped")


def test_servers_register_again_after_a_tracker_restart():
    with local_farm(keys=["k", "k", "other"]) as farm:
        tracker = farm.client()
        held = tracker.request("k", timeout=HANG_S)
        farm.restart_tracker(down_s=1.0)
        wait_until(lambda: key_status(tracker, "k")["total"] == 2
                   and key_status(tracker, "other")["total"] == 1, "re-registration")
        # The session opened before the restart keeps its device.
        assert key_status(tracker, "k")["free"] == 1
        assert held.listdir() == []
        with tracker.request("k", timeout=HANG_S) as sess:
            assert sess.address != held.address
        held.close()
        wait_until(lambda: key_status(tracker, "k")["free"] == 2, "old session's device freed")


# ----------------------------------------------------------------- access --

def test_farm_secret_is_required_to_register_and_to_request():
    with local_farm(keys=["k"], tracker_args=["--farm-secret", "s3cret"],
                    TETHER_FARM_SECRET="s3cret") as farm:
        host, port = farm.tracker
        with pytest.raises(errors.AuthenticationError, match="farm secret.*TETHER_FARM_SECRET"):
            rpc.connect_tracker(host, port, farm_secret="wrong").request("k", timeout=5)
        with pytest.raises(errors.AuthenticationError, match="farm secret"):
            rpc.connect_tracker(host, port, farm_secret="").request("k", timeout=5)
        with rpc.connect_tracker(host, port, farm_secret="s3cret").request(
                "k", timeout=HANG_S) as sess:
            assert sess.listdir() == []
        intruder = farm.add_server("k", extra=["--farm-secret", "guess"], wait=False)
        wait_until(lambda: "wrong or missing farm secret" in intruder.log_text(),
                   "refused registration logged")
        assert key_status(farm.client(), "k")["total"] == 1


def make_self_signed_pair(folder):
    cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-keyout", key, "-out", cert, "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_tls_for_tracker_and_device_traffic(tmp_path, kind):
    if kind == "native":
        pytest.skip("the native server has no TLS library (docs/boards.md)")
    cert, key = make_self_signed_pair(str(tmp_path))
    tls_args = ["--tls-cert", cert, "--tls-key", key]
    with local_farm(keys=["k"], tracker_args=tls_args, server_args=tls_args,
                    TETHER_TLS_CA=cert) as farm:
        host, port = farm.tracker
        with rpc.connect_tracker(host, port, tls_ca=cert).request("k", timeout=HANG_S) as sess:
            sess.upload(b"over tls", target="f.bin")
            assert sess.listdir() == ["f.bin"]
            assert sess.download("f.bin") == b"over tls"
            # Bulk data takes the session's direct connection: it must be TLS too.
            assert isinstance(sess._data.sock, ssl.SSLSocket)
        with pytest.raises(errors.ConnectionFailed, match="TLS.*tls_ca"):
            rpc.connect_tracker(host, port, tls_ca="").summary()
        device_port = farm.servers[0].port
        with pytest.raises(errors.ConnectionFailed):
            rpc.connect("127.0.0.1", device_port, tls_ca="", timeout=HANG_S)


# ------------------------------------------------------------- visibility --

def test_tether_status_shows_devices_holders_and_queue():
    with local_farm(keys=[]) as farm:
        farm.add_server("k", extra=["--attr", "board=rpi4"])
        tracker = farm.client()
        cli = [sys.executable, "-m", "remote.cli", "status", "--tracker",
               f"127.0.0.1:{farm.tracker[1]}"]
        with tracker.request("k", timeout=HANG_S, client="alice@lab") as alice:
            served = []

            def wait_in_queue():
                # Bob waits until Alice gives the board back, which she does only
                # once both `tether status` runs have shown him in the queue.
                with tracker.request("k", priority=3, timeout=HANG_S, client="bob@ci") as bob:
                    served.append(bob.address)

            waiter = threading.Thread(target=wait_in_queue)
            waiter.start()
            wait_until(lambda: key_status(tracker, "k")["pending"] == 1, "queued")
            data = json.loads(subprocess.run(cli + ["--json"], env=farm.env, check=True,
                                             capture_output=True, text=True,
                                             timeout=HANG_S).stdout)
            text = subprocess.run(cli, env=farm.env, check=True, capture_output=True,
                                  text=True, timeout=HANG_S).stdout
        waiter.join(HANG_S)
        assert served == [alice.address], "bob is served once alice gives the board back"
        (device,) = data["devices"]
        assert device["state"] == "in_use" and device["holder"] == "alice@lab"
        attributes = dict(device["attributes"])
        # The board's own word on how far sessions are isolated (docs/security.md).
        assert attributes.pop("isolation").split(",")[0] == "processes"
        assert device["held_since"] <= time.time() and attributes == {"board": "rpi4"}
        assert device["triple"] and device["cores"] >= 1
        assert data["keys"] == [{"key": "k", "total": 1, "free": 0, "pending": 1}]
        (waiting,) = data["waiting"]
        assert (waiting["client"], waiting["priority"]) == ("bob@ci", 3)
        for word in ("alice@lab", "bob@ci", "in_use", "board=rpi4", device["address"]):
            assert word in text

"""tether bootstrap against a real OpenSSH server on loopback; the "board" is this machine."""
import getpass
import os
import subprocess
import sys
import time

import pytest

from deploy_recipes import bootstrap as bs
from deploy_recipes.devicecode import device_files
from tests.ssh_board import free_port, known_hosts_line, pid_alive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
@pytest.fixture(scope="module")
def tracker():
    from remote.cli.localfarm import LocalFarm
    with LocalFarm(keys=[], env={**os.environ, "PYTHONPATH": ROOT}) as farm:
        yield farm


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "remote.cli", *args], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                          env={**os.environ, "PYTHONPATH": ROOT, **(env or {})}, timeout=300)


def test_install_upgrade_and_uninstall_over_ssh(sshd, tracker, tmp_path, stop_leftover_server):
    known = tmp_path / "known_hosts"
    known.write_text(known_hosts_line(sshd))
    remote_dir = tmp_path / "board-home" / ".tether"
    port = free_port()
    args = [f"{getpass.getuser()}@127.0.0.1:{sshd.port}", "--tracker",
            f"127.0.0.1:{tracker.tracker[1]}", "--key", "ssh-board", "--identity", str(sshd.user_key),
            "--known-hosts", str(known), "--service", "background", "--python", sys.executable,
            "--remote-dir", str(remote_dir), "--port", str(port)]
    first = _cli("bootstrap", *args)
    assert first.returncode == 0, first.stderr
    assert "suggested target: host" in first.stdout
    assert f"key=ssh-board address=127.0.0.1:{port}" in first.stdout
    # It says what the board keeps its sessions from, as the tracker shows it,
    # and what the server could not give them.
    (device,) = [d for d in tracker_summary(tracker)["devices"] if d["key"] == "ssh-board"]
    isolation = device["attributes"]["isolation"]
    assert f"isolation of its sessions: {isolation}\n" in first.stdout
    assert isolation.startswith("processes")
    assert "no --session-limit" in first.stdout
    if os.geteuid() != 0:
        assert "no per-session user: this server does not run as root" in first.stdout
    installed = sorted(str(p.relative_to(remote_dir / "code")).replace(os.sep, "/")
                       for p in (remote_dir / "code").rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts)
    assert installed == device_files()
    assert not (remote_dir / "code" / "crosscompile").exists()
    pid = int((remote_dir / "server.pid").read_text())
    assert pid_alive(pid)

    # the installed server really serves through the tracker
    from remote import rpc
    with rpc.connect_tracker(*tracker.tracker).request("ssh-board", timeout=30) as sess:
        assert sess.device_info()["machine"]

    # running it again upgrades in place: a new server process, still one device
    (remote_dir / "code" / "stale.py").write_text("left from an old version\n")
    second = _cli("bootstrap", *args)
    assert second.returncode == 0, second.stderr
    assert not (remote_dir / "code" / "stale.py").exists()
    new_pid = int((remote_dir / "server.pid").read_text())
    assert new_pid != pid and not pid_alive(pid) and pid_alive(new_pid)
    time.sleep(6)  # past the tracker's eviction window: the old server is gone for good
    devices = [d for d in tracker_summary(tracker)["devices"] if d["key"] == "ssh-board"]
    assert len(devices) == 1 and devices[0]["address"] == f"127.0.0.1:{port}"

    gone = _cli("bootstrap", "--uninstall", *args)
    assert gone.returncode == 0, gone.stderr
    assert "uninstalled" in gone.stdout
    assert not remote_dir.exists()
    assert not pid_alive(new_pid)


def tracker_summary(farm):
    from remote.client.tracker import TrackerClient
    with TrackerClient(*farm.tracker) as client:
        return client.summary()


def _args(sshd, tracker, tmp_path, known, identity=None, extra=()):
    return [f"{getpass.getuser()}@127.0.0.1:{sshd.port}", "--tracker",
            f"127.0.0.1:{tracker.tracker[1]}", "--key", "ssh-err",
            "--identity", str(identity or sshd.user_key), "--known-hosts", str(known),
            "--service", "background", "--python", sys.executable,
            "--remote-dir", str(tmp_path / "never"), *extra]


def test_wrong_key_is_an_authentication_failure(sshd, tracker, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text(known_hosts_line(sshd))
    out = _cli("bootstrap", *_args(sshd, tracker, tmp_path, known, identity=sshd.other_key))
    assert out.returncode == 1
    assert "refused the login" in out.stderr and "other_key" in out.stderr
    assert not (tmp_path / "never").exists()


def test_unknown_host_key_is_refused_until_accepted(sshd, tracker, tmp_path):
    known = tmp_path / "known_hosts"
    out = _cli("bootstrap", *_args(sshd, tracker, tmp_path, known))
    assert out.returncode == 1
    fingerprint = subprocess.run(["ssh-keygen", "-lf", str(sshd.host_key) + ".pub"],
                                 stdout=subprocess.PIPE, universal_newlines=True).stdout.split()[1]
    assert "unknown" in out.stderr and fingerprint in out.stderr
    assert "--accept-new-host-key" in out.stderr
    assert not known.exists() or str(sshd.port) not in known.read_text()

    # accepted once, recorded, and the next contact needs no flag; missing python is named
    out = _cli("bootstrap", *_args(sshd, tracker, tmp_path, known,
                                   extra=["--accept-new-host-key", "--python", "/nonexistent/python3"]))
    assert out.returncode == 1
    assert "no '/nonexistent/python3'" in out.stderr
    assert f"[127.0.0.1]:{sshd.port}" in known.read_text()


def test_changed_host_key_is_refused(sshd, tracker, tmp_path):
    known = tmp_path / "known_hosts"
    other = (sshd.other_key.parent / "other_key.pub").read_text().split()
    known.write_text(f"[127.0.0.1]:{sshd.port} {other[0]} {other[1]}\n")
    out = _cli("bootstrap", *_args(sshd, tracker, tmp_path, known, extra=["--accept-new-host-key"]))
    assert out.returncode == 1
    assert "CHANGED" in out.stderr and "ssh-keygen" in out.stderr
    assert other[1] in known.read_text(), "the recorded key must stay as it was"


def test_unreachable_tracker_is_reported_from_the_board(sshd, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text(known_hosts_line(sshd))
    closed = free_port()
    out = _cli("bootstrap", f"{getpass.getuser()}@127.0.0.1:{sshd.port}",
               "--tracker", f"127.0.0.1:{closed}", "--identity", str(sshd.user_key),
               "--known-hosts", str(known), "--python", sys.executable,
               "--remote-dir", str(tmp_path / "never"))
    assert out.returncode == 1
    assert f"cannot reach the tracker at 127.0.0.1:{closed}" in out.stderr
    assert not (tmp_path / "never").exists()


def test_target_suggestions_for_known_boards():
    pi5 = {"machine": "aarch64", "board_model": "Raspberry Pi 5 Model B Rev 1.0"}
    jetson = {"machine": "aarch64", "board_model": "NVIDIA Jetson Nano Developer Kit",
              "cpu_part": "0xd07"}
    assert bs.suggest_target(pi5) == "rasp5"
    assert bs.suggest_target({**pi5, "machine": "armv7l"}) == "rasp4b"
    assert bs.suggest_target(jetson) == "aarch64-unknown-linux-gnu/cortex-a57/+neon"
    assert bs.suggest_target({"machine": "aarch64", "android": True}) == "android-arm64"
    from crosscompile.target import resolve_target
    for probe in (pi5, jetson, {"machine": "armv7l", "cpu_part": "0xd08"}):
        assert resolve_target(bs.suggest_target(probe)).triple  # the compiler takes it

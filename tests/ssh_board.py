"""A real OpenSSH server on loopback that stands for a board, for the tests of
``tether bootstrap`` (tests/test_bootstrap.py, tests/test_native_tools.py);
conftest.py makes it the ``sshd`` fixture."""
import os
import shutil
import socket
import subprocess
import time

SSHD = shutil.which("sshd", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keygen(path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


class SSHServer:
    """sshd on 127.0.0.1 with its own host key, config and authorized_keys."""

    def __init__(self, folder):
        self.folder = folder
        self.port = free_port()
        self.host_key = folder / "host_key"
        self.user_key = folder / "user_key"
        self.other_key = folder / "other_key"
        for key in (self.host_key, self.user_key, self.other_key):
            _keygen(key)
        (folder / "authorized_keys").write_text((folder / "user_key.pub").read_text())
        (folder / "sshd_config").write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {self.host_key}\n"
            f"PidFile {folder}/sshd.pid\nUsePAM no\nStrictModes no\n"
            f"AuthorizedKeysFile {folder}/authorized_keys\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
            "PermitUserEnvironment no\nSubsystem sftp internal-sftp\nLogLevel VERBOSE\n")
        self.proc = None

    def start(self):
        if os.getuid() == 0:
            os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
        self.log = open(self.folder / "sshd.log", "wb")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.folder / "sshd_config")],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                return self
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        raise RuntimeError(f"sshd did not start: {(self.folder / 'sshd.log').read_text()}")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.log.close()


def known_hosts_line(sshd) -> str:
    kind, key = (sshd.host_key.parent / "host_key.pub").read_text().split()[:2]
    return f"[127.0.0.1]:{sshd.port} {kind} {key}\n"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of an exited server still answers kill 0
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"

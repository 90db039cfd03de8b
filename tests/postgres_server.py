"""A real PostgreSQL server for the farm-database tests, started from Debian's
`postgresql` package (tests/run.sh installs it as root): initdb in a temporary
folder, listening on a free loopback port, run as `nobody` when the tests run
as root (PostgreSQL refuses to run as root). Skips with the reason when the
binaries or a user to run them as are missing."""
from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid

import pytest

START_TIMEOUT_S = 60


def _binaries() -> str:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    if initdb:
        return os.path.dirname(os.path.realpath(initdb))
    pytest.skip("needs PostgreSQL's server binaries: apt-get install postgresql "
                "(tests/run.sh does as root)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self, folder: str, port: int, user: str, run_as, bindir: str):
        self.folder, self.port, self.user, self._run_as = folder, port, user, run_as
        self._bindir = bindir

    def stop(self) -> None:
        """Stop the server at once, as a crash or an admin would."""
        stop(self._run_as, self._bindir, os.path.join(self.folder, "data"))

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database on this server; its URL."""
        import sqlalchemy as sa

        name = "farm_" + uuid.uuid4().hex[:12]
        engine = sa.create_engine(self.url(), isolation_level="AUTOCOMMIT")
        with engine.connect() as connection:
            connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
        engine.dispose()
        return self.url(name)


@contextlib.contextmanager
def postgres_server():
    pytest.importorskip("psycopg", reason="needs psycopg (pip install 'tether[test]')")
    bindir = _binaries()
    prefix = []
    user = pwd.getpwuid(os.getuid()).pw_name
    if os.getuid() == 0:
        # Looked for in the system folders too: a clean environment has no PATH.
        runuser = shutil.which("runuser") or shutil.which(
            "runuser", path="/usr/sbin:/sbin:/usr/bin:/bin")
        if runuser is None:
            pytest.skip("running as root, and PostgreSQL refuses root: needs runuser "
                        "(util-linux) to run it as nobody")
        user = "nobody"
        prefix = [runuser, "-u", user, "--"]
    folder = tempfile.mkdtemp(prefix="tether-postgres-")
    os.chmod(folder, 0o755)
    if prefix:
        os.chown(folder, pwd.getpwnam(user).pw_uid, -1)
    data, log = os.path.join(folder, "data"), os.path.join(folder, "server.log")
    port = _free_port()
    try:
        done = subprocess.run(prefix + [os.path.join(bindir, "initdb"), "-D", data, "-A", "trust",
                                        "-U", user, "--no-sync", "-E", "UTF8"],
                              capture_output=True, text=True, timeout=START_TIMEOUT_S)
        assert done.returncode == 0, f"initdb failed: {done.stdout[-1500:]}{done.stderr[-1500:]}"
        options = f"-p {port} -k {folder} -h 127.0.0.1 -F"
        done = subprocess.run(prefix + [os.path.join(bindir, "pg_ctl"), "-D", data, "-l", log,
                                        "-o", options, "-w", "-t", str(START_TIMEOUT_S),
                                        "start"],
                              capture_output=True, text=True, timeout=START_TIMEOUT_S + 10)
        if done.returncode != 0:
            with open(log) as f:
                raise AssertionError(f"PostgreSQL did not start: {done.stderr[-1000:]}\n"
                                     f"{f.read()[-2000:]}")
        yield PostgresServer(folder, port, user, prefix, bindir)
    finally:
        stop(prefix, bindir, data)
        shutil.rmtree(folder, ignore_errors=True)


def stop(prefix, bindir: str, data: str) -> None:
    if os.path.exists(os.path.join(data, "postmaster.pid")):
        subprocess.run(prefix + [os.path.join(bindir, "pg_ctl"), "-D", data, "-m", "immediate",
                                 "-w", "stop"], capture_output=True, timeout=START_TIMEOUT_S)

"""`tether` commands run as a user runs them, and what they leave behind.

Shared by tests/test_installed_copy.py, tests/test_temp_folders.py and
tests/test_emulate_failures.py.
"""
import contextlib
import os
import signal
import subprocess
import threading

import pytest

from deploy_recipes import emulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def skip_without_emulation_tools(arch="arm64", release="bookworm"):
    """Skip the calling test when the host lacks what emulated ``release`` ``arch`` boards need."""
    missing = emulate.missing_tools(arch, release)
    if missing:
        pytest.skip(f"emulated {release} {arch} boards need Debian packages: "
                    f"apt-get install {' '.join(missing)}")


def wait_for_line(proc, wanted, timeout, what=None):
    """The first line of ``proc``'s stdout (text mode) for which ``wanted(line)`` is true.

    Fails the test with every line seen so far (and the stderr, once ``proc`` is
    killed) when none comes within ``timeout`` seconds or the output ends first:
    a child that stops talking must not hang the suite.
    """
    seen, found, done = [], [], threading.Event()

    def read():
        try:
            for line in proc.stdout:
                seen.append(line)
                if wanted(line):
                    found.append(line)
                    break
        except (OSError, ValueError):
            pass  # the pipe was closed under us: the deadline path reports
        done.set()

    threading.Thread(target=read, name="stdout-reader", daemon=True).start()
    done.wait(timeout)
    if found:
        return found[0]
    ended = done.is_set()
    proc.kill()
    try:
        err = proc.stderr.read() if proc.stderr is not None else ""
    except (OSError, ValueError):
        err = ""
    why = "its output ended" if ended else f"none came within {timeout:g} s"
    pytest.fail(f"waited for {what or 'a line'} from {proc.args!r}; {why}.\n"
                f"stdout so far:\n{''.join(seen)}\nstderr:\n{err}")


def start_emulate(command, farm, key, env, cwd=ROOT):
    """``tether emulate`` for bookworm arm64 (``command`` is how tether is run), once
    ``farm``'s tracker lists it under ``key``; returns the process and its first line."""
    emulate.build_rootfs("bookworm", "arm64")
    proc = subprocess.Popen(
        [*command, "emulate", "--arch", "arm64", "--release", "bookworm",
         "--tracker", f"127.0.0.1:{farm.tracker[1]}", "--key", key],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
        universal_newlines=True)
    line = wait_for_line(proc, lambda _line: True, 600, "tether emulate's first line")
    if "emulated bookworm arm64 board listening on 127.0.0.1:" not in line:
        proc.kill()
        pytest.fail(f"tether emulate did not start: {line}{proc.communicate()[1]}")
    farm.wait_for_devices(key, 1, timeout=120)
    return proc, line


def _finish(proc, timeout=60):
    """Wait for ``proc`` to end (killing it after ``timeout``); its exit code and stderr."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


def interrupt(proc, timeout=60):
    """Ctrl-C ``proc`` and wait for it to end; its exit code and stderr."""
    proc.send_signal(signal.SIGINT)
    return _finish(proc, timeout)


@contextlib.contextmanager
def ended(proc):
    """``proc``, killed on the way out if it still runs (a check before its end failed)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        _finish(proc)


def descendants(pid):
    """The pids of every living process below ``pid``."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        todo += children
    return found


def running(pid):
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def command_line(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

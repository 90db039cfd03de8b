"""A session's folder on the board; every name a client sends is checked here."""
from __future__ import annotations

import os
import shutil
import tempfile

from remote.errors import InvalidArgument


# Longer or deeper names are refused before the file system sees them.
MAX_NAME_CHARS = 1024
MAX_NAME_DEPTH = 32


class Workspace:
    """One folder per session, removed with ``close()``.

    >>> ws = Workspace()
    >>> ws.path("net.so").endswith("/net.so")
    True
    >>> ws.path("../etc/passwd")
    Traceback (most recent call last):
    ...
    remote.errors.InvalidArgument: file name '../etc/passwd' is not allowed: use a plain relative name inside the session workspace (no absolute path, no '..')
    >>> ws.close()
    """

    def __init__(self, parent: str = None, root: str = None):
        # ``root``: attach to a folder another process made (the session's worker).
        self.root = os.path.realpath(root or tempfile.mkdtemp(prefix="tether-session-", dir=parent))

    def path(self, name: str) -> str:
        """The absolute path of ``name`` inside the workspace, or InvalidArgument."""
        parts = name.replace("\\", "/").split("/")
        if len(name) > MAX_NAME_CHARS or len(parts) > MAX_NAME_DEPTH:
            raise InvalidArgument(
                f"file name of {len(name)} characters and {len(parts)} folders is too long: "
                f"at most {MAX_NAME_CHARS} characters and {MAX_NAME_DEPTH} folders deep")
        if (not name or name.startswith("/") or "\x00" in name
                or any(p in ("", ".", "..") for p in parts)):
            raise InvalidArgument(
                f"file name {name!r} is not allowed: use a plain relative name inside the "
                "session workspace (no absolute path, no '..')")
        full = os.path.join(self.root, *parts)
        # A symlink planted inside the folder must not lead out of it.
        real = os.path.realpath(full)
        if real != self.root and not real.startswith(self.root + os.sep):
            raise InvalidArgument(f"file name {name!r} leads outside the session workspace")
        return full

    def existing(self, name: str) -> str:
        full = self.path(name)
        if not os.path.isfile(full):
            raise InvalidArgument(f"no file {name!r} in the session workspace; upload it first "
                                  f"(present: {', '.join(self.listdir()) or 'nothing'})")
        return full

    def remove(self, name: str) -> None:
        """Delete one file of the workspace."""
        full = self.existing(name)
        os.remove(full)

    def listdir(self):
        """Names of the regular files inside the workspace; a symlink that leads
        out of it is left out (it cannot be read, downloaded or loaded)."""
        names = []
        for folder, _, files in os.walk(self.root):
            for f in files:
                full = os.path.join(folder, f)
                real = os.path.realpath(full)
                if real.startswith(self.root + os.sep) and os.path.isfile(real):
                    names.append(os.path.relpath(full, self.root))
        return sorted(names)

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)

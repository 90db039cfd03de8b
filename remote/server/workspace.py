"""A session's folder on the board; every name a client sends is checked here."""
from __future__ import annotations

import os
import shutil
import tempfile

from remote.errors import InvalidArgument


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
        names = []
        for folder, _, files in os.walk(self.root):
            for f in files:
                names.append(os.path.relpath(os.path.join(folder, f), self.root))
        return sorted(names)

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)

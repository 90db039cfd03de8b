"""User tokens: one per person or CI job, issued by the tracker's admin.

    tether token add alice            # prints alice's token, once
    tether tracker --require-tokens   # requests, releases and the summary need one

The token file (``--tokens``, default ``~/.config/tether/tokens.json``) keeps a
SHA-256 of each token with its name, never the token itself. The tracker
reads it again whenever it changes, so adding or removing a user needs no
restart. The holder a summary shows is the token's name, whatever the client
calls itself.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
from typing import Dict, Optional

DEFAULT_TOKENS_FILE = os.path.join(os.path.expanduser("~"), ".config", "tether", "tokens.json")


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()


class TokenBook:
    """The names and token digests in one file."""

    def __init__(self, path: str = DEFAULT_TOKENS_FILE):
        self.path = path
        self._lock = threading.Lock()
        self._stamp = None
        self._names: Dict[str, str] = {}   # digest -> name

    def _read(self) -> Dict[str, str]:
        try:
            with open(self.path) as f:
                return dict(json.load(f).get("users", {}))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the token file {self.path}: {exc}") from None

    def name_of(self, token: str) -> Optional[str]:
        """The name a token was issued to, or None."""
        if not token:
            return None
        with self._lock:
            try:
                stat = os.stat(self.path)
                stamp = (stat.st_mtime_ns, stat.st_size)
            except OSError:
                stamp = None
            if stamp != self._stamp:
                self._names = {digest: name for name, digest in self._read().items()}
                self._stamp = stamp
            digest = _digest(token)
            for known, name in self._names.items():
                if hmac.compare_digest(known, digest):
                    return name
        return None

    def names(self):
        return sorted(self._read())

    def add(self, name: str) -> str:
        """Issue (or replace) ``name``'s token; returns it. Only its digest is kept."""
        if not name or not name.isprintable() or len(name) > 100:
            raise ValueError(f"a token's name must be printable text of 1-100 characters, "
                             f"not {name!r}")
        users = self._read()
        token = "tt_" + secrets.token_urlsafe(24)
        users[name] = _digest(token)
        self._write(users)
        return token

    def remove(self, name: str) -> None:
        users = self._read()
        if name not in users:
            raise KeyError(f"no token named {name!r} in {self.path} "
                           f"(names: {', '.join(sorted(users)) or 'none'})")
        del users[name]
        self._write(users)

    def _write(self, users: Dict[str, str]) -> None:
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, mode=0o700, exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"users": users}, f, indent=2, sort_keys=True)
        os.replace(tmp, self.path)

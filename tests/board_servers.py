"""The two device servers the session, tracker and bench suites run against:
the Python one (``python -m remote.server``) and the native C++ one
(remote/server/native), built for this machine. A client must not be able to
tell them apart, so the same tests run against both.

    @pytest.fixture(scope="module", params=board_servers.KINDS)
    def server_command(request):
        return board_servers.command(request.param)
"""
from __future__ import annotations

import functools
import platform
from typing import List

import pytest

from remote.cli.localfarm import python_argv

KINDS = ("python", "native")


@functools.lru_cache(maxsize=None)
def _native_binary() -> str:
    from remote.cli.native import NativeBuildError, build_native
    try:
        return build_native(platform.machine())
    except NativeBuildError as exc:
        return "skip: " + str(exc)


def command(kind: str) -> List[str]:
    """The argv that starts a device server of ``kind`` (it takes the server's options after it)."""
    if kind == "python":
        return python_argv("remote.server")
    path = _native_binary()
    if path.startswith("skip: "):
        pytest.skip(f"the native server cannot be built here: {path[6:]}")
    return [path]

"""Defaults the host falls back on when nothing is given, named once.

    >>> cache_dir()                                     # doctest: +SKIP
    '/home/pi/.cache/tether'
"""
from __future__ import annotations

import os

# The host's caches: emulated boards' root filesystems, tuned register tiles.
CACHE_ENV = "TETHER_CACHE"


def cache_dir() -> str:
    """``$TETHER_CACHE`` or ``~/.cache/tether``."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "tether")

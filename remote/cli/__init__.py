"""The ``tether`` command line (host side)."""
from remote.cli.main import main

__all__ = ["main"]

"""The device server that runs on each board (``python -m remote.server``)."""
from remote.server.daemon import serve

__all__ = ["serve"]

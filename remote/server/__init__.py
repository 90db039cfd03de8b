"""The device server that runs on each board (``python -m remote.server``)."""

__all__ = ["serve"]


def __getattr__(name):
    # Lazy, so that the session processes (remote.server.worker) start
    # without importing the server's own modules.
    if name == "serve":
        from remote.server.daemon import serve
        return serve
    raise AttributeError(f"module 'remote.server' has no attribute {name!r}")

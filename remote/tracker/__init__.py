"""The tracker daemon: pools device servers by key and leases them to clients."""
from remote.tracker.service import TrackerService, serve

__all__ = ["TrackerService", "serve"]

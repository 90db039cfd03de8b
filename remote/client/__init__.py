"""Host-side client: sessions on device servers and the tracker client."""
from remote.client.session import RemoteModule, Session
from remote.client.tracker import TrackerClient

__all__ = ["RemoteModule", "Session", "TrackerClient"]

"""Host-side client: sessions on device servers and the tracker client."""
from remote.client.session import BenchmarkResult, RemoteModule, RemoteTensor, Session
from remote.client.tracker import TrackerClient

__all__ = ["BenchmarkResult", "RemoteModule", "RemoteTensor", "Session", "TrackerClient"]

"""A client's session on one device server, and the modules loaded in it."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Dict, List, Optional, Sequence, Union

import grpc
import numpy as np

from remote import errors, tls
from remote.proto import CHANNEL_OPTIONS, make_stub, pb
from remote.proto.tensors import from_message, to_message

# 1 MiB chunks: large enough that per-message overhead vanishes, small enough
# that neither side holds more than a few of them in memory.
CHUNK_BYTES = 1 << 20

Progress = Callable[[int, int], None]


def _call(what: str, method, request, timeout: Optional[float]):
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as exc:
        raise errors.from_rpc_error(exc, what) from None


class Session:
    """An open session on a device server; close it (or use ``with``) to free the board.

    >>> with rpc.connect("127.0.0.1", 9090) as sess:          # doctest: +SKIP
    ...     sess.upload("net.so")
    ...     out = sess.load_module("net.so").run({"input": x})
    """

    def __init__(self, address: str, lease_token: str = "", session_timeout: float = 0.0,
                 client: str = "", timeout: Optional[float] = 30.0,
                 on_close: Optional[Callable[[], None]] = None, tls_ca: Optional[str] = None):
        self.address = address
        self.timeout = timeout
        self._on_close = on_close
        self._channel = tls.open_channel(address, tls_ca)  # TLS when tls_ca or $TETHER_TLS_CA
        self._stub = make_stub(self._channel, "Device")
        self._closed = False
        try:
            reply = _call(f"device server {address}", self._stub.OpenSession,
                          pb.OpenSessionRequest(lease_token=lease_token, client=client,
                                                session_timeout_s=session_timeout), timeout)
        except BaseException:
            self._channel.close()
            if on_close is not None:
                on_close()
            raise
        self.session_id = reply.session_id
        self._info = reply.info

    # ------------------------------------------------------------- state --
    def device_info(self) -> dict:
        """What the board reported: triple, CPU, cores, memory, OS, versions."""
        info = self._info
        return {
            "triple": info.triple, "machine": info.machine, "cpu_model": info.cpu_model,
            "cpu_features": list(info.cpu_features), "cores": info.cores,
            "memory_bytes": info.memory_bytes, "os": info.os,
            "python": info.python_version, "numpy": info.numpy_version,
            "grpcio": info.grpcio_version, "protobuf": info.protobuf_version,
            "attributes": dict(info.attributes), "server_version": info.server_version,
        }

    def _rpc(self, method, request, timeout=None):
        if self._closed:
            raise errors.SessionError("this session is closed; open a new one")
        return _call(f"device server {self.address}", method, request,
                     self.timeout if timeout is None else timeout)

    # --------------------------------------------------------- transfers --
    def upload(self, path_or_bytes: Union[str, os.PathLike, bytes], target: Optional[str] = None,
               progress: Optional[Progress] = None, timeout: Optional[float] = None) -> str:
        """Send a file (or bytes) to the session workspace; returns its name there.

        ``progress(sent_bytes, total_bytes)`` is called after every chunk.
        """
        if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
            if not target:
                raise ValueError("upload of bytes needs target='name' for the file on the device")
            data = bytes(path_or_bytes)
            total = len(data)
            sha = hashlib.sha256(data).hexdigest()

            def chunks_of_source():
                for i in range(0, total, CHUNK_BYTES):
                    yield data[i:i + CHUNK_BYTES]
        else:
            path = os.fspath(path_or_bytes)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"cannot upload {path!r}: no such file")
            target = target or os.path.basename(path)
            total = os.path.getsize(path)
            sha = _file_sha256(path)

            def chunks_of_source():
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(CHUNK_BYTES), b""):
                        yield block

        def messages():
            sent = 0
            first = True
            for block in chunks_of_source():
                sent += len(block)
                yield pb.UploadChunk(session_id=self.session_id if first else "",
                                     name=target if first else "", total_size=total,
                                     data=block, sha256=sha if sent == total else "")
                first = False
                if progress is not None:
                    progress(sent, total)
            if first:  # an empty file is still one message
                yield pb.UploadChunk(session_id=self.session_id, name=target, sha256=sha)

        reply = self._rpc(self._stub.Upload, messages(), timeout)
        return reply.name

    def listdir(self) -> List[str]:
        """Names of the files in the session workspace."""
        reply = self._rpc(self._stub.ListDir, pb.SessionRef(session_id=self.session_id))
        return [f.name for f in reply.files]

    # ----------------------------------------------------------- modules --
    def load_module(self, name: str) -> "RemoteModule":
        """Load an uploaded module (``.so``) on the device."""
        reply = self._rpc(self._stub.LoadModule,
                          pb.LoadModuleRequest(session_id=self.session_id, name=name))
        return RemoteModule(self, reply.module_id, json.loads(reply.metadata_json), reply.load_s)

    # --------------------------------------------------------- lifecycle --
    def close(self) -> None:
        """End the session: the workspace is removed and the board is free again."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stub.CloseSession(pb.SessionRef(session_id=self.session_id), timeout=5.0)
        except grpc.RpcError:
            pass  # the device is gone or already ended the session; nothing to free there
        finally:
            self._channel.close()
            if self._on_close is not None:
                self._on_close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Session {self.address} {self._info.triple} {state}>"


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


class RemoteModule:
    """A module loaded on the device; ``run`` is one round trip."""

    def __init__(self, session: Session, module_id: str, metadata: dict, load_s: float):
        self.session = session
        self.module_id = module_id
        self.metadata = metadata
        self.load_s = load_s
        self.last_run_s: Optional[float] = None

    @property
    def input_names(self) -> List[str]:
        return [t["name"] for t in self.metadata["inputs"]]

    @property
    def output_names(self) -> List[str]:
        return [t["name"] for t in self.metadata["outputs"]]

    def run(self, inputs: Union[Dict[str, np.ndarray], Sequence[np.ndarray]],
            timeout: Optional[float] = None) -> List[np.ndarray]:
        """Run the module on the device: inputs in, outputs out, in one round trip.

        ``inputs`` is a dict by input name or a list in input order. The time the
        module itself took on the device is kept in ``last_run_s``.
        """
        if not isinstance(inputs, dict):
            inputs = list(inputs)
            if len(inputs) != len(self.input_names):
                raise errors.InputError(
                    f"module takes {len(self.input_names)} input(s) "
                    f"{self.input_names}, got {len(inputs)}")
            inputs = dict(zip(self.input_names, inputs))
        request = pb.RunRequest(session_id=self.session.session_id, module_id=self.module_id,
                                inputs=[to_message(n, a) for n, a in inputs.items()])
        reply = self.session._rpc(self.session._stub.Run, request, timeout)
        self.last_run_s = reply.run_s
        return [from_message(t) for t in reply.outputs]

    def __repr__(self) -> str:
        return f"<RemoteModule {self.module_id} on {self.session.address}>"

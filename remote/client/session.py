"""A client's session on one device server, and the modules loaded in it."""
from __future__ import annotations

import json
import os
import socket
import ssl
import threading
from typing import Callable, Dict, List, Optional, Sequence, Union

import numpy as np

try:  # gives numpy the types it lacks (bfloat16, float8, int4, ...), which some modules take and give
    import ml_dtypes  # noqa: F401
except ImportError:  # their tensors then come back as unsigned integers of their bits
    pass

from remote import errors, tls
from remote.client import display
from remote.address import split_address
from remote.defaults import SERVER_PORT, TLS_CA_ENV
from remote.proto import pb
from remote.proto.frames import (CHUNK_BYTES, CUT_SHORT, PROTOCOL_VERSION, Checksum,
                                 FrameSocket, aligned_empty, byte_view, frame_bytes, little_endian,
                                 looks_like_http2, page_buffer, recv_array_chunks, recv_tensors,
                                 send_array_chunks, send_file_chunks, tensor_header)


Progress = Callable[[int, int], None]
# The least time a board gets to end a session before the client returns the lease itself.
CLOSE_TIMEOUT_S = 30.0
# benchmark() without number: runs per sample, fewer when a sample would pass this long.
AUTO_NUMBER = 10
AUTO_SAMPLE_S = 1.0


def board_call(address: str, first, ca: str, timeout: Optional[float], what: str):
    """Open a connection to a board (or the tracker relaying to one) and send
    its first frame; returns (FrameSocket, reply header)."""
    host, port = split_address(address, SERVER_PORT)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise errors.ConnectionFailed(
            f"cannot reach {what} at {address}: {exc.strerror or exc}. Is it running, and is "
            "the address right?") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        context = tls.client_context(ca)
        if context is not None:
            try:
                sock = context.wrap_socket(sock, server_hostname=host)
            except (ssl.SSLError, OSError) as exc:
                raise errors.ConnectionFailed(
                    f"TLS handshake with {what} at {address} failed: {exc}") from None
        fs = FrameSocket(sock)
        fs.set_timeout(timeout)
        first.version = PROTOCOL_VERSION
        try:
            fs.send(first)
            reply = fs.recv_header()
        except (socket.timeout, BlockingIOError):
            raise errors.RequestTimeout(f"{what} at {address} did not answer within "
                                        f"{timeout:g} s") from None
        except OSError as exc:
            if looks_like_http2(exc):
                raise errors.ConnectionFailed(
                    f"{what} at {address} answered in gRPC: it runs Tether's protocol v1 and "
                    f"this client protocol v{PROTOCOL_VERSION}; update Tether on the board "
                    "(tether bootstrap) to the version here") from None
            hint = ("" if ca else f"; if it serves TLS, give the certificate to trust "
                    f"(--tls-ca FILE on the command line, tls_ca= in Python, or {TLS_CA_ENV})")
            raise errors.ConnectionFailed(f"{what} at {address} closed the connection: "
                                          f"{exc}{hint}") from None
        if reply.op == "error":
            fs.close()
            raise _error_class(reply.error)(reply.text)
        return fs, reply
    except BaseException:
        sock.close()
        raise


def device_info_dict(info: pb.DeviceInfo) -> dict:
    """A board's DeviceInfo as plain data: triple, CPU, cores, memory, OS, versions.

    >>> device_info_dict(pb.DeviceInfo(triple="aarch64-unknown-linux-gnu", cores=4))["cores"]
    4
    """
    return {
        "triple": info.triple, "machine": info.machine, "cpu_model": info.cpu_model,
        "cpu_features": list(info.cpu_features), "cores": info.cores,
        "memory_bytes": info.memory_bytes, "os": info.os,
        "python": info.python_version, "numpy": info.numpy_version,
        "grpcio": info.grpcio_version, "protobuf": info.protobuf_version,
        "attributes": dict(info.attributes), "server_version": info.server_version,
        "emulated": info.emulated,
    }


class Session:
    """An open session on a device server; close it (or use ``with``) to free the board.

    The session is one connection (board protocol v2): its first frame opens
    the session, every call is a frame on it, and the session ends with it.

    >>> with rpc.connect("127.0.0.1", 9090) as sess:          # doctest: +SKIP
    ...     sess.upload("net.so")
    ...     out = sess.load_module("net.so").run({"input": x})
    """

    def __init__(self, address: str, lease_token: str = "", session_timeout: float = 0.0,
                 client: str = "", timeout: Optional[float] = 30.0,
                 on_close: Optional[Callable[[], None]] = None, tls_ca: Optional[str] = None,
                 device_id: str = "", relayed: bool = False):
        self.address = address
        self.timeout = timeout
        self.relayed = relayed
        self._device_id = device_id
        # The tracker's id of the board (empty for a server reached directly).
        self.device_id = device_id
        # A relayed board's tracker carries status and close only for the lease's holder.
        self._lease_token = lease_token
        self._on_close = on_close
        self._tls_ca = tls.default_ca(tls_ca)  # TLS when tls_ca or $TETHER_TLS_CA
        self._closed = False
        what = "the tracker relaying to its board" if relayed else "device server"
        try:
            self._data, reply = board_call(
                address, pb.DataFrame(op="open", token=lease_token, client=client,
                                      session_timeout_s=session_timeout),
                self._tls_ca, timeout, what)
        except BaseException:
            if on_close is not None:
                on_close()
            raise
        self.session_id = reply.name
        self._info = reply.info
        self.max_upload_bytes = reply.size
        self._data_lock = threading.Lock()
        self._data_timeout = timeout

    # ------------------------------------------------------------- state --
    def device_info(self) -> dict:
        """What the board reported: triple, CPU, cores, memory, OS, versions."""
        return device_info_dict(self._info)

    def _exchange(self, what: str, timeout: Optional[float], send, receive=None,
                  returns_nothing: bool = False):
        """One request/reply on the data connection.

        ``send(fs)`` writes the request; ``receive(fs, reply)`` reads what
        follows a successful reply header and returns the result (default:
        the header; None for a call that ``returns_nothing``, whose plain
        ``ok`` answer is then recognised by its bytes). A broken connection
        means the device ended the session: the server is asked why, and
        that becomes the exception.
        """
        if self._closed:
            raise errors.SessionError("this session is closed; open a new one")
        with self._data_lock:
            fs = self._data
            if isinstance(fs, _ClosedData):
                raise self._why_ended(what)
            wait = self.timeout if timeout is None else timeout
            if wait != self._data_timeout:  # a syscall or two: only when it changes
                fs.set_timeout(wait)
                self._data_timeout = wait
            try:
                try:
                    send(fs)
                    if returns_nothing and fs.take_ok():
                        return None
                    reply = fs.recv_header()
                    if reply.op == "error":
                        cls = _error_class(reply.error)
                        if issubclass(cls, errors.SessionEnded):
                            self._abandon()
                        else:
                            fs.skip(fs.body_left)
                        raise cls(reply.text)
                    if receive is not None:
                        return receive(fs, reply)
                    return None if returns_nothing else reply
                except (errors.TetherError, OSError):
                    raise
                except BaseException as exc:
                    # Interrupted half way through a frame: the stream is out of step.
                    self._abandon()
                    if isinstance(exc, KeyboardInterrupt):
                        # Ctrl-C in a notebook must not leave the board held.
                        self.close()
                    raise
            except errors.TetherError:
                raise  # RequestTimeout is a TimeoutError, which socket.timeout also is
            except (socket.timeout, BlockingIOError):
                self._abandon()
                raise errors.RequestTimeout(
                    f"{what} on {self.address} got no answer within "
                    f"{self.timeout if timeout is None else timeout:g} s; the session is "
                    "closed. Give it more time (timeout=, or --timeout on the command line), "
                    "or ask for less (number=/repeat=, --number/--repeat)") from None
            except OSError:
                self._abandon()
                raise self._why_ended(what) from None

    def _abandon(self):
        """The data connection is out of step or gone: no call may use it again."""
        self._data.close()
        self._data = _ClosedData()

    def _why_ended(self, what: str) -> errors.TetherError:
        """The session's connection broke: ask the board, on a new connection, why."""
        try:
            fs, state = board_call(self.address, pb.DataFrame(
                op="status", name=self.session_id, device_id=self._device_id,
                token=self._lease_token),
                self._tls_ca, 10.0, "device server")
            fs.close()
        except errors.TetherError as exc:
            return exc
        if state.open:
            return errors.ConnectionFailed(
                f"{what}: the connection to {self.address} broke, but the session is "
                "still open on the device; close it and open a new one")
        cls = _error_class(state.error, errors.SessionEnded)
        return cls(f"{what} failed: the device ended the session: {state.text}. "
                   "Open a new session to go on")

    def ping(self, timeout: Optional[float] = None) -> None:
        """One empty round trip to the board (what a small call costs)."""
        self._exchange("ping", timeout, _send_ping, returns_nothing=True)

    # --------------------------------------------------------- transfers --
    def upload(self, path_or_bytes: Union[str, os.PathLike, bytes], target: Optional[str] = None,
               progress: Optional[Progress] = None, timeout: Optional[float] = None) -> str:
        """Send a file (or bytes) to the session workspace; returns its name there.

        The data streams in chunks with a checksum checked on the board;
        ``progress(sent_bytes, total_bytes)`` is called with 0 once the transfer
        has begun, then after every chunk.

        >>> sess.upload("net.so", progress=lambda done, total: None)   # doctest: +SKIP
        'net.so'
        """
        if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
            if not target:
                raise ValueError("upload of bytes needs target='name' for the file on the device")
            data = byte_view(path_or_bytes)
            total = data.nbytes
        else:
            path = os.fspath(path_or_bytes)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"cannot upload {path!r}: no such file")
            target = target or os.path.basename(path)
            total = os.path.getsize(path)
            data = None
        self._check_size(f"upload of {target!r}", total)

        def send(fs):
            fs.send_prefix(pb.DataFrame(op="upload", name=target, size=total), total)
            # A bar shows at once, not only after the first chunk: on a slow link
            # or a busy board that chunk alone can take a while.
            if progress is not None:
                progress(0, total)
            if data is not None:
                checksum = send_array_chunks(fs, np.frombuffer(data, np.uint8), progress)
            else:
                with open(path, "rb", buffering=0) as f:
                    checksum = send_file_chunks(fs, f, total, progress)
                if checksum is None:
                    # The body went out whole (zeros after the file's end); the
                    # board discards it on this checksum and answers an error.
                    fs.send(pb.DataFrame(op="end", checksum=CUT_SHORT))
                    fs.recv_header()
                    fs.skip(fs.body_left)
                    raise errors.InvalidArgument(
                        f"{path!r} shrank while it was sent (another program is writing "
                        "it?); nothing was kept on the board: upload it again once it is "
                        "complete")
            fs.send(pb.DataFrame(op="end", checksum=checksum))

        return self._exchange(f"upload of {target!r}", timeout, send).name

    def download(self, name: str, path: Union[str, os.PathLike, None] = None,
                 progress: Optional[Progress] = None,
                 timeout: Optional[float] = None) -> Union[bytes, str]:
        """Fetch a workspace file: its bytes, or written to ``path`` (then returns ``path``).

        >>> sess.download("out.bin", "local.bin")                 # doctest: +SKIP
        'local.bin'
        """
        def receive(fs, reply):
            total = reply.size
            checksum = Checksum()
            out = _open_for_writing(path) if path is not None else None
            data = page_buffer(total) if out is None else None
            buffer = page_buffer(CHUNK_BYTES) if out is not None else None
            done = 0
            try:
                while done < total:
                    n = min(CHUNK_BYTES, total - done)
                    view = data[done:done + n] if out is None else buffer[:n]
                    fs.recv_body_into(view)
                    checksum.update(view)
                    if out is not None:
                        out.write(view)
                    done += n
                    if progress is not None:
                        progress(done, total)
                end = fs.recv_header()
            finally:
                if out is not None:
                    out.close()
            if end.op == "error":
                raise _error_class(end.error)(end.text)
            if end.checksum != checksum.text():
                if path is not None:
                    os.remove(path)
                raise errors.RemoteError(f"download of {name!r} arrived corrupt: "
                                         f"{checksum.text()} here, {end.checksum} on the board")
            return os.fspath(path) if path is not None else bytes(data)

        return self._exchange(f"download of {name!r}", timeout,
                              lambda fs: fs.send(pb.DataFrame(op="download", name=name)), receive)

    def listdir(self) -> List[str]:
        """Names of the files in the session workspace."""
        reply = self._exchange("listing of the workspace", None,
                               lambda fs: fs.send(pb.DataFrame(op="list")))
        return [f.name for f in reply.files]

    def remove(self, name: str) -> None:
        """Delete a file from the session workspace."""
        self._exchange(f"removal of {name!r}", None,
                       lambda fs: fs.send(pb.DataFrame(op="remove", name=name)),
                       returns_nothing=True)

    def _check_size(self, what: str, size: int) -> None:
        if self.max_upload_bytes and size > self.max_upload_bytes:
            raise errors.InvalidArgument(
                f"{what} is {size} bytes; this device accepts at most {self.max_upload_bytes} "
                "(server option --max-upload-bytes)")

    # ----------------------------------------------------------- tensors --
    def upload_tensor(self, name: str, array, progress: Optional[Progress] = None,
                      timeout: Optional[float] = None) -> "RemoteTensor":
        """Copy ``array`` to the board and keep it there under ``name``.

        The copy streams in chunks with a checksum checked on the board;
        ``progress(sent_bytes, total_bytes)`` is called after every chunk.

        >>> x = sess.upload_tensor("x", np.zeros((1, 4), np.float32))   # doctest: +SKIP
        >>> mod.run({"input": x})                                       # doctest: +SKIP
        """
        data = little_endian(array)
        total = data.nbytes
        self._check_size(f"tensor {name!r}", total)
        header = pb.DataFrame(op="put_tensor", name=name, tensors=[tensor_header(name, data)])

        def send(fs):
            fs.send_prefix(header, total)
            fs.send(pb.DataFrame(op="end", checksum=send_array_chunks(fs, data, progress)))

        self._exchange(f"upload of tensor {name!r}", timeout, send)
        return RemoteTensor(self, name, tuple(data.shape), data.dtype.name)

    def download_tensor(self, name: str, progress: Optional[Progress] = None,
                        timeout: Optional[float] = None) -> np.ndarray:
        """Copy a tensor kept on the board back as a numpy array."""
        def receive(fs, reply):
            (desc,) = reply.tensors
            array = aligned_empty(tuple(desc.shape), np.dtype(desc.dtype).newbyteorder("<"))
            received = recv_array_chunks(fs, array, progress)
            end = fs.recv_header()
            if end.checksum != received:
                raise errors.RemoteError(f"tensor {name!r} arrived corrupt: {received} "
                                         f"here, {end.checksum} on the board")
            return array.astype(array.dtype.newbyteorder("="), copy=False)

        return self._exchange(f"download of tensor {name!r}", timeout,
                              lambda fs: fs.send(pb.DataFrame(op="get_tensor", name=name)),
                              receive)

    def free_tensor(self, name: str) -> None:
        self._exchange(f"free of tensor {name!r}", None,
                       lambda fs: fs.send(pb.DataFrame(op="free_tensor", name=name)),
                       returns_nothing=True)

    # ----------------------------------------------------------- modules --
    def load_module(self, name: str, timeout: Optional[float] = None) -> "RemoteModule":
        """Load an uploaded module on the device.

        ``name`` is a ``.so`` built for the board, or a ``.tar`` of object files
        plus metadata.json that the board links with its C compiler.
        """
        reply = self._exchange(f"load of {name!r}", timeout,
                               lambda fs: fs.send(pb.DataFrame(op="load", name=name)))
        return RemoteModule(self, reply.name, json.loads(reply.text), reply.seconds)

    # --------------------------------------------------------- lifecycle --
    def close(self) -> None:
        """End the session: the workspace is removed and the board is free again."""
        if self._closed:
            return
        confirmed = False
        try:
            if self._data_lock.acquire(blocking=False):
                try:
                    fs = self._data
                    if not isinstance(fs, _ClosedData):
                        fs.set_timeout(self._close_timeout())
                        fs.send(pb.DataFrame(op="close"))
                        confirmed = fs.recv_header().op == "ok"
                finally:
                    self._data_lock.release()
            else:
                # Another thread is in the middle of a call (Ctrl-C during a
                # benchmark): that call ends with the connection.
                sock = getattr(self._data, "sock", None)
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
        except (OSError, errors.TetherError):
            pass  # the device is gone or already ended the session
        try:
            if not confirmed:
                confirmed = self._end_out_of_band(self._close_timeout())
        finally:
            self._closed = True
            self._data.close()
            # A device that confirmed the close returns its lease itself, after its
            # session is gone; returning it from here too could hand the board to
            # the next client while this session is still being torn down.
            if not confirmed and self._on_close is not None:
                self._on_close()

    def _end_out_of_band(self, timeout: Optional[float]) -> bool:
        """End the session from a new connection (the session id is its key):
        for a session whose own connection is busy, broken or stuck. True once
        the board has ended it and given the board back."""
        try:
            fs, _ = board_call(self.address, pb.DataFrame(
                op="close", name=self.session_id, device_id=self._device_id,
                token=self._lease_token),
                self._tls_ca, timeout, "device server")
            fs.close()
            return True
        except errors.TetherError:
            return False

    def _close_timeout(self) -> Optional[float]:
        """How long the board may take to end the session: as long as any call may,
        and never under half a minute. Giving up sooner returns the lease from here
        while a slow board (emulated, or loaded) is still tearing the session down,
        and the next client it goes to would find it busy."""
        return None if self.timeout is None else max(CLOSE_TIMEOUT_S, self.timeout)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<Session {self.address} {self._info.triple} {state}>"

    def __str__(self) -> str:
        return display.session_text(self)

    def _repr_html_(self) -> str:
        return display.session_html(self)


def _open_for_writing(path):
    """Open ``path`` to be written from scratch. A regular file already
    there is removed first rather than truncated: ext4 (auto_da_alloc)
    writes a truncated-and-rewritten file's data out as it is closed, which
    held downloads to a fraction of their speed."""
    if os.path.isfile(path) and not os.path.islink(path):
        os.remove(path)
    return open(path, "wb")


def _error_class(name: str, default=errors.RemoteError):
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.TetherError):
        return cls
    return default


class _ClosedData:
    """Stands in for a data connection that had to be dropped."""

    sock = None

    def __getattr__(self, name):
        raise errors.SessionError("this session's data connection was lost; open a new session")

    def close(self):
        pass


_PING = frame_bytes(pb.DataFrame(op="ping"))


def _send_ping(fs: FrameSocket) -> None:
    fs.send_raw(_PING)


class RemoteTensor:
    """A tensor kept on the board between runs; pass it as a run input.

    >>> x = sess.upload_tensor("x", np.ones((1, 4), np.float32))     # doctest: +SKIP
    >>> mod.run({"input": x})                                        # doctest: +SKIP
    >>> x.numpy()                                                    # doctest: +SKIP
    """

    def __init__(self, session: Session, name: str, shape: tuple, dtype: str):
        self.session = session
        self.name = name
        self.shape = shape
        self.dtype = dtype

    def numpy(self, progress: Optional[Progress] = None,
              timeout: Optional[float] = None) -> np.ndarray:
        """Copy the tensor back from the board."""
        return self.session.download_tensor(self.name, progress, timeout)

    def free(self) -> None:
        """Drop the tensor from the board's memory."""
        self.session.free_tensor(self.name)

    def __repr__(self) -> str:
        return f"<RemoteTensor {self.name!r} {self.dtype}{list(self.shape)} on {self.session.address}>"


class BenchmarkResult:
    """Times measured on the board, in seconds.

    ``samples`` has one entry per repeat: the mean time of ``number`` runs.
    """

    def __init__(self, data: dict):
        self.samples: List[float] = list(data["samples"])
        self.number: int = data["number"]
        self.repeat: int = data["repeat"]
        self.mean: float = data["mean"]
        self.median: float = data["median"]
        self.std: float = data["std"]
        self.min: float = data["min"]
        self.max: float = data["max"]
        self.p90: float = data["p90"]
        self.p99: float = data["p99"]
        self.load_s: float = data["load_s"]
        #: the most memory the session's process on the board held (0: not reported)
        self.peak_rss_bytes: int = int(data.get("peak_rss_bytes", 0))
        #: threads each timed run used, as run() does on the board (0: not reported)
        self.threads: int = int(data.get("threads", 0))

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in (
            "samples", "number", "repeat", "mean", "median", "std", "min", "max", "p90",
            "p99", "load_s", "peak_rss_bytes", "threads")}

    def __str__(self) -> str:
        return display.benchmark_text(self)

    def _repr_html_(self) -> str:
        return display.benchmark_html(self)

    def __repr__(self) -> str:
        return (f"<BenchmarkResult median {self.median * 1e3:.4f} ms, mean "
                f"{self.mean * 1e3:.4f} ± {self.std * 1e3:.4f} ms, min {self.min * 1e3:.4f} ms, "
                f"{self.repeat}×{self.number} runs, load {self.load_s * 1e3:.1f} ms>")


class ProfileResult:
    """Per-step times of one module on the board, slowest first.

    ``rows`` holds one dict per step (a kernel call): ``op``, ``name``,
    ``fused`` (ops merged into it), ``inputs``/``outputs`` (shapes),
    ``mean_s`` (seconds per run) and ``share`` (of the sum of all steps).
    """

    def __init__(self, data: dict):
        self.number: int = int(data["number"])
        self.rows: List[dict] = sorted(data["rows"], key=lambda r: r["mean_s"], reverse=True)

    @property
    def total_s(self) -> float:
        """Seconds per run, summed over the steps."""
        return sum(r["mean_s"] for r in self.rows)

    def as_dict(self) -> dict:
        return {"number": self.number, "rows": [dict(r) for r in self.rows]}

    def __str__(self) -> str:
        return display.profile_text(self)

    def _repr_html_(self) -> str:
        return display.profile_html(self)

    def __repr__(self) -> str:
        top = self.rows[0] if self.rows else None
        slowest = f", slowest {top['op']} {top['name']!r} {top['share']:.0%}" if top else ""
        return f"<ProfileResult {len(self.rows)} steps, {self.total_s * 1e3:.4f} ms{slowest}>"


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

    def _request(self, op: str, inputs, timeout: Optional[float]):
        if inputs is None:
            inputs = {}
        elif not isinstance(inputs, dict):
            inputs = list(inputs)
            if len(inputs) != len(self.input_names):
                raise errors.InputError(
                    f"module takes {len(self.input_names)} input(s) "
                    f"{self.input_names}, got {len(inputs)}")
            inputs = dict(zip(self.input_names, inputs))
        refs, names, arrays = {}, [], []
        for name, value in inputs.items():
            if isinstance(value, RemoteTensor):
                if value.session is not self.session:
                    raise errors.InputError(f"input {name!r}: {value!r} lives in another session")
                refs[name] = value.name
            else:
                names.append(name)
                arrays.append(little_endian(value))
        wait = self.session.timeout if timeout is None else timeout
        header = pb.DataFrame(op=op, name=self.module_id, refs=refs, timeout_s=wait or 0.0,
                              tensors=[tensor_header(n, a) for n, a in zip(names, arrays)])
        # The board stops the module at ``wait``; its answer needs a little longer.
        return header, arrays, (None if wait is None else wait + 5.0)

    def run(self, inputs: Union[Dict[str, object], Sequence[object]],
            timeout: Optional[float] = None) -> List[np.ndarray]:
        """Run the module on the device: inputs in, outputs out, in one round trip.

        ``inputs`` is a dict by input name or a list in input order; a value is
        a numpy array or a RemoteTensor already on the board. The board stops a
        run that takes longer than ``timeout`` (default: the session's) and
        ends the session (RunTimeout). The time the module itself took on the
        device is kept in ``last_run_s``.

        >>> (out,) = mod.run({"input": x})                     # doctest: +SKIP
        """
        header, arrays, wait = self._request("run", inputs, timeout)

        def receive(fs, reply):
            self.last_run_s = reply.seconds
            return recv_tensors(fs, reply.tensors)

        return self.session._exchange(f"run of {self.module_id}", wait,
                                      lambda fs: fs.send(header, arrays), receive)

    def benchmark(self, number: Optional[int] = None, repeat: int = 3, min_repeat_ms: float = 0,
                  cooldown_ms: float = 0, inputs=None,
                  timeout: Optional[float] = None) -> BenchmarkResult:
        """Time the module on the board: ``repeat`` samples, each the mean of ``number`` runs.

        ``min_repeat_ms`` grows ``number`` until one sample lasts that long;
        ``cooldown_ms`` sleeps between samples. Inputs default to zeros.
        Without ``number`` or ``timeout``, one run is timed on the board first:
        ``number`` is then 10, or fewer so that a sample takes about a second
        (1 on an emulated board that needs seconds per run), and the timeout
        covers the whole loop three times over.

        >>> res = mod.benchmark(number=10, repeat=5)           # doctest: +SKIP
        >>> res.median, res.p99, res.load_s                    # doctest: +SKIP
        """
        if (number is not None and number < 1) or repeat < 1:
            raise ValueError(f"number ({number}) and repeat ({repeat}) must be at least 1")
        if min_repeat_ms < 0 or cooldown_ms < 0:
            raise ValueError("min_repeat_ms and cooldown_ms must not be negative")
        if number is None or timeout is None:
            run_s = self.probe(inputs)
            if number is None:
                number = AUTO_NUMBER if run_s * AUTO_NUMBER <= AUTO_SAMPLE_S else \
                    max(1, int(AUTO_SAMPLE_S / max(run_s, 1e-9)))
            if timeout is None:
                planned = (run_s * (1 + number * repeat)
                           + repeat * (min_repeat_ms * 2 + cooldown_ms) / 1e3)
                timeout = max(self.session.timeout or 0.0, 3 * planned + 10.0)
        header, arrays, wait = self._request("benchmark", inputs, timeout)
        header.number, header.repeat = int(number), int(repeat)
        header.min_repeat_ms, header.cooldown_ms = float(min_repeat_ms), float(cooldown_ms)
        reply = self.session._exchange(f"benchmark of {self.module_id}", wait,
                                       lambda fs: fs.send(header, arrays))
        return BenchmarkResult(json.loads(reply.text))

    def probe(self, inputs=None) -> float:
        """Seconds one run takes on the board (the board's own clock); inputs
        default to zeros."""
        given = dict(inputs or {}) if isinstance(inputs, dict) or inputs is None else \
            dict(zip(self.input_names, inputs))
        for spec in self.metadata["inputs"]:
            if spec["name"] not in given:
                given[spec["name"]] = np.zeros(spec["shape"], dtype=spec["dtype"])
        self.run(given)
        return self.last_run_s or 0.0

    def profile(self, number: int = 10, inputs=None,
                timeout: Optional[float] = None) -> ProfileResult:
        """Time each step (kernel call) of the module on the board, single
        threaded, averaged over ``number`` runs. Inputs default to zeros.
        A module built before per-step profiling existed raises
        ModuleLoadError: rebuild it with this crosscompile.

        >>> prof = mod.profile(number=20)                      # doctest: +SKIP
        >>> print(prof)                                        # slowest steps first  # doctest: +SKIP
        """
        if not isinstance(number, int) or isinstance(number, bool) or number < 1:
            raise ValueError(f"number must be a positive integer, got {number!r}")
        header, arrays, wait = self._request("profile", inputs, timeout)
        header.number = number
        reply = self.session._exchange(f"profile of {self.module_id}", wait,
                                       lambda fs: fs.send(header, arrays))
        return ProfileResult(json.loads(reply.text))

    def __repr__(self) -> str:
        return f"<RemoteModule {self.module_id} on {self.session.address}>"

    def __str__(self) -> str:
        return display.module_text(self)

    def _repr_html_(self) -> str:
        return display.module_html(self)

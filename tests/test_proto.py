"""The tether.v1 message layer: up to date with the .proto, and wire-compatible
between the oldest protobuf a board has (3.12, Debian bullseye) and the newest."""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from remote.client.grpc_layer import make_stub
from remote.proto import FILE, pb
from remote.proto.descriptor import FILE_DESCRIPTOR

ROOT = pathlib.Path(__file__).resolve().parent.parent
OLD_PROTOBUF = "3.12.4"
OLD_VENV = pathlib.Path(os.environ.get("TETHER_CACHE", pathlib.Path.home() / ".cache" / "tether")) \
    / f"venv-protobuf-{OLD_PROTOBUF}"


def test_checked_in_descriptor_matches_proto_source():
    pytest.importorskip("grpc_tools", reason="pip install grpcio-tools to check the descriptor")
    from remote.cli.protogen import compile_descriptor
    assert compile_descriptor() == FILE_DESCRIPTOR, \
        "remote/proto/descriptor.py is stale: run `python -m remote.cli.protogen`"


def test_services_and_messages_are_built():
    # Boards speak frames (protocol v2); gRPC is only what users call on the tracker.
    assert set(FILE.services_by_name) == {"Tracker"}
    lease = pb.Lease(token="t", info=pb.DeviceInfo(cores=4, attributes={"board": "rpi4"}))
    again = pb.Lease.FromString(lease.SerializeToString())
    assert again.info.attributes["board"] == "rpi4" and again.info.cores == 4


def test_stub_knows_streaming_methods():
    class Channel:
        def __getattr__(self, kind):
            return lambda path, **kw: (kind, path)
    stub = make_stub(Channel(), "Tracker")
    assert stub.RequestDevice == ("unary_unary", "/tether.v1.Tracker/RequestDevice")
    assert stub.Summary == ("unary_unary", "/tether.v1.Tracker/Summary")


def _old_python():
    python = OLD_VENV / "bin" / "python"
    if python.exists():
        return python
    try:
        subprocess.run([sys.executable, "-m", "venv", str(OLD_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"protobuf=={OLD_PROTOBUF}"],
                       check=True, timeout=300)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"could not install protobuf {OLD_PROTOBUF} into {OLD_VENV}: {exc}")
    return python


OLD_SIDE = textwrap.dedent("""
    import sys, google.protobuf
    from remote.proto import pb
    assert google.protobuf.__version__ == sys.argv[1], google.protobuf.__version__
    incoming = pb.DataFrame.FromString(bytes.fromhex(sys.stdin.read()))
    assert incoming.version == 2 and incoming.op == "run", incoming
    t = incoming.tensors[0]
    reply = pb.DataFrame(op="ok", seconds=0.5, id=incoming.id, tensors=[pb.Tensor(
        name=t.name + "-out", dtype=t.dtype, shape=list(t.shape))],
        files=[pb.FileInfo(name="net.so", size=1 << 33)], refs=dict(incoming.refs))
    info = pb.DeviceInfo(triple="armv7l-unknown-linux-gnueabihf", attributes={"board": "rpi3"})
    sys.stdout.write(reply.SerializeToString().hex() + " " + info.SerializeToString().hex())
""")


def test_old_protobuf_runtime_speaks_the_same_wire_format():
    python = _old_python()
    request = pb.DataFrame(op="run", version=2, id=7, name="m", refs={"y": "kept"},
                           tensors=[pb.Tensor(name="x", dtype="float32", shape=[1, 2])])
    result = subprocess.run([str(python), "-c", OLD_SIDE, OLD_PROTOBUF],
                            input=request.SerializeToString().hex(), capture_output=True,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    reply_hex, info_hex = result.stdout.split()
    reply = pb.DataFrame.FromString(bytes.fromhex(reply_hex))
    assert reply.seconds == 0.5 and reply.id == 7 and reply.refs["y"] == "kept"
    assert reply.tensors[0].name == "x-out" and list(reply.tensors[0].shape) == [1, 2]
    assert reply.files[0].size == 1 << 33
    info = pb.DeviceInfo.FromString(bytes.fromhex(info_hex))
    assert info.attributes["board"] == "rpi3"

"""The gRPC half of the protocol, host only: the tracker's service as users call it.

Stubs and servicers are built from the same serialized descriptor as the
messages, with grpcio's generic handlers (present since grpcio 1.0). Errors
cross as a status code with the class name in the trailing metadata key
``tether-error``; ``from_rpc_error`` turns them back into the typed exception.
Boards never import this module: they speak frames (remote/proto/frames.py).
"""
from __future__ import annotations

import types
from typing import Optional

import grpc

from remote.errors import _BY_NAME, _BY_STATUS, RemoteError, TetherError
from remote.proto import FILE, PACKAGE, message_class
from remote.proto.descriptor import FILE_DESCRIPTOR
from remote.tls import _read, default_ca

ERROR_METADATA_KEY = "tether-error"
# Large enough for a summary of a big farm; nothing bulky travels over gRPC.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# What the tracker takes: its requests are a few hundred bytes, so anything
# larger is refused before it is parsed or held (whatever secret it carries).
MAX_REQUEST_BYTES = 64 * 1024
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
]


def _methods(service_name):
    service = FILE.services_by_name[service_name]
    for method in service.methods:
        request = message_class(method.input_type)
        reply = message_class(method.output_type)
        yield method.name, request, reply


def _streaming_flags(service_name):
    # MethodDescriptor has no streaming flags before protobuf 4; read the proto form.
    from google.protobuf import descriptor_pb2

    fdp = descriptor_pb2.FileDescriptorProto.FromString(FILE_DESCRIPTOR)
    (svc,) = [s for s in fdp.service if s.name == service_name]
    return {m.name: (m.client_streaming, m.server_streaming) for m in svc.method}


_STUB_FACTORIES = {
    (False, False): "unary_unary",
    (True, False): "stream_unary",
    (False, True): "unary_stream",
    (True, True): "stream_stream",
}


def make_stub(channel, service_name: str):
    """A client stub for ``service_name`` ("Tracker") on ``channel``."""
    flags = _streaming_flags(service_name)
    stub = types.SimpleNamespace()
    for name, request, reply in _methods(service_name):
        factory = getattr(channel, _STUB_FACTORIES[flags[name]])
        setattr(stub, name, factory(
            f"/{PACKAGE}.{service_name}/{name}",
            request_serializer=request.SerializeToString,
            response_deserializer=reply.FromString,
        ))
    return stub


def add_servicer(server, service_name: str, servicer) -> None:
    """Register ``servicer`` (an object with one method per RPC) on a grpc server."""
    flags = _streaming_flags(service_name)
    handler_makers = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for name, request, reply in _methods(service_name):
        handlers[name] = handler_makers[flags[name]](
            getattr(servicer, name),
            request_deserializer=request.FromString,
            response_serializer=reply.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(f"{PACKAGE}.{service_name}", handlers),)
    )


def open_channel(address: str, ca: Optional[str] = None, options=None):
    """A gRPC channel to ``address``; TLS trusting the PEM file ``ca`` when one is given.

    ``ca=None`` falls back to ``$TETHER_TLS_CA``; ``ca=""`` forces plaintext.
    """
    ca = default_ca(ca)
    options = list(CHANNEL_OPTIONS if options is None else options)
    if not ca:
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(root_certificates=_read(ca, "CA certificate"))
    return grpc.secure_channel(address, credentials, options=options)


def abort(context, error: TetherError):
    """Abort the RPC behind ``context`` with ``error``'s status and class name."""
    context.set_trailing_metadata(((ERROR_METADATA_KEY, type(error).__name__),))
    context.abort(getattr(grpc.StatusCode, error.status), str(error))


def from_rpc_error(exc, what: str = "") -> TetherError:
    """The typed error for a grpc.RpcError; ``what`` names the peer for messages."""
    code = exc.code()
    detail = exc.details() or ""
    name = ""
    for key, value in (exc.trailing_metadata() or ()):
        if key == ERROR_METADATA_KEY:
            name = value
    cls = _BY_NAME.get(name) or _BY_STATUS.get(code.name, RemoteError)
    if not name and code.name == "UNAVAILABLE":
        detail = f"cannot reach {what or 'the peer'}: {detail}. Is it running, and is the address right?"
    elif not name and code.name == "DEADLINE_EXCEEDED":
        detail = f"{what or 'the call'} timed out: {detail}"
    return cls(detail)

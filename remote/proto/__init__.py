"""The tether.v1 message and stub layer, built at import time.

Message classes come from the serialized descriptor in ``descriptor.py`` (made
from ``tether_v1.proto`` by ``python -m remote.cli.protogen``) through APIs that
protobuf 3.12 and the newest releases both have; stubs and servicers use
grpcio's generic handlers, present since grpcio 1.0. So the same files work on
a board with Debian bullseye's python3-protobuf and on a laptop with today's.

    >>> from remote.proto import pb
    >>> pb.Tensor(name="x", dtype="float32", shape=[1, 4]).shape[1]
    4
"""
from __future__ import annotations

import types

from google.protobuf import descriptor_pool, message_factory

from remote.proto.descriptor import FILE_DESCRIPTOR

PACKAGE = "tether.v1"
FILE_NAME = "tether_v1.proto"

# Large enough for one tensor of a small model in a single message; bulk files
# travel as streamed chunks and never come near it.
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def _build_pool():
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(FILE_DESCRIPTOR)  # returns None on protobuf < 3.19
    return pool, pool.FindFileByName(FILE_NAME)


def _message_class(desc):
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.21
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(desc.file.pool).GetPrototype(desc)


_POOL, FILE = _build_pool()

#: Namespace of every message class: ``pb.Tensor``, ``pb.Lease``, ...
pb = types.SimpleNamespace(**{
    name: _message_class(desc) for name, desc in FILE.message_types_by_name.items()
})


def _methods(service_name):
    service = FILE.services_by_name[service_name]
    for method in service.methods:
        request = _message_class(method.input_type)
        reply = _message_class(method.output_type)
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
    """A client stub for ``service_name`` ("Tracker" or "Device") on ``channel``."""
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
    import grpc

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

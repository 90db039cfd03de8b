"""The tether.v1 messages, built at import time.

Message classes come from the serialized descriptor in ``descriptor.py`` (made
from ``tether_v1.proto`` by ``python -m remote.cli.protogen``) through APIs that
protobuf 3.12 and the newest releases both have. So the same files work on a
board with Debian bullseye's python3-protobuf and on a laptop with today's.
The gRPC half (the tracker's service, host only) is remote/client/grpc_layer.py.

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

def _build_pool():
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(FILE_DESCRIPTOR)  # returns None on protobuf < 3.19
    return pool, pool.FindFileByName(FILE_NAME)


def message_class(desc):
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.21
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(desc.file.pool).GetPrototype(desc)


_POOL, FILE = _build_pool()

#: Namespace of every message class: ``pb.Tensor``, ``pb.Lease``, ...
pb = types.SimpleNamespace(**{
    name: message_class(desc) for name, desc in FILE.message_types_by_name.items()
})



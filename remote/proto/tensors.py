"""numpy arrays to and from ``tether.v1.Tensor`` messages."""
from __future__ import annotations

import numpy as np

from remote.proto import pb


def to_message(name: str, array) -> "pb.Tensor":
    """Encode ``array`` (C order, little-endian) as a Tensor message."""
    array = np.asarray(array)
    little = array.dtype.newbyteorder("<")
    data = np.ascontiguousarray(array, dtype=little).tobytes()
    return pb.Tensor(name=name, dtype=array.dtype.name, shape=list(array.shape), data=data)


def from_message(tensor) -> np.ndarray:
    """Decode a Tensor message into a new writable numpy array."""
    try:
        dtype = np.dtype(tensor.dtype).newbyteorder("<")
    except TypeError:
        raise ValueError(f"tensor {tensor.name!r} has unknown dtype {tensor.dtype!r}")
    shape = tuple(tensor.shape)
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(tensor.data) != expected:
        raise ValueError(f"tensor {tensor.name!r}: {len(tensor.data)} bytes of data for shape "
                         f"{shape} {dtype.name} (needs {expected})")
    return np.frombuffer(tensor.data, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))

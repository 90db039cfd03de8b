"""One exception hierarchy for everything a Tether user can hit.

Device-side and host-side code share it. On a board's frames an error travels
as an ``error`` frame naming the class; on the tracker's gRPC service, as a
status code with the class name in the trailing metadata ``tether-error``
(remote/client/grpc_layer.py turns both ways). Either way the client raises
the same class.
"""
from __future__ import annotations

class TetherError(Exception):
    """Base class of every error Tether raises on purpose."""

    #: name of the grpc.StatusCode attribute this error travels as
    status = "UNKNOWN"


class ConnectionFailed(TetherError):
    """The tracker or device server could not be reached."""

    status = "UNAVAILABLE"


class AuthenticationError(TetherError):
    """A farm secret or lease token was missing, wrong or already used."""

    status = "PERMISSION_DENIED"


class RequestTimeout(TetherError, TimeoutError):
    """A blocking call did not finish within its timeout."""

    status = "DEADLINE_EXCEEDED"


class NoSuchKey(TetherError, LookupError):
    """No device serves the requested key."""

    status = "NOT_FOUND"


class DeviceBusy(TetherError):
    """The device already runs as many sessions as it allows."""

    status = "RESOURCE_EXHAUSTED"


class SessionError(TetherError):
    """The session is unknown, closed or expired."""

    status = "FAILED_PRECONDITION"


class InvalidArgument(TetherError, ValueError):
    """A request named something that does not exist or is malformed."""

    status = "INVALID_ARGUMENT"


class InputError(InvalidArgument):
    """Inputs given to a module do not match its inputs (name, shape, dtype)."""


class ModuleLoadError(TetherError):
    """A module file could not be loaded on the device."""

    status = "FAILED_PRECONDITION"


class RemoteError(TetherError):
    """The device failed while doing what was asked; the message carries its traceback."""

    status = "INTERNAL"


class SessionEnded(SessionError):
    """The device ended the session (timeout, lost client); open a new one."""


class ModuleCrashed(SessionEnded):
    """The module killed the process running it (e.g. a segfault); the session is over."""


class RunTimeout(SessionEnded, RequestTimeout):
    """A module run did not finish in time; the device stopped it and ended the session."""


_BY_NAME = {cls.__name__: cls for cls in (
    TetherError, ConnectionFailed, AuthenticationError, RequestTimeout, NoSuchKey,
    DeviceBusy, SessionError, InvalidArgument, InputError, ModuleLoadError, RemoteError,
    SessionEnded, ModuleCrashed, RunTimeout,
)}

_BY_STATUS = {
    "UNAVAILABLE": ConnectionFailed,
    "PERMISSION_DENIED": AuthenticationError,
    "UNAUTHENTICATED": AuthenticationError,
    "DEADLINE_EXCEEDED": RequestTimeout,
    "NOT_FOUND": NoSuchKey,
    "RESOURCE_EXHAUSTED": DeviceBusy,
    "FAILED_PRECONDITION": SessionError,
    "INVALID_ARGUMENT": InvalidArgument,
}

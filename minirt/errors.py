"""Exceptions raised by minirt."""


class MinirtError(Exception):
    """Base of every error minirt raises."""


class ModuleLoadError(MinirtError):
    """A file cannot be loaded as a Tether module on this machine."""


class InputError(MinirtError, ValueError):
    """Inputs passed to Module.run do not match the module's inputs."""


class RunError(MinirtError):
    """The module's entry point reported an error."""

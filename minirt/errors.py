"""Exceptions raised by minirt."""


class MinirtError(Exception):
    """Base of every error minirt raises."""


class ModuleLoadError(MinirtError):
    """A file cannot be loaded as a Tether module on this machine."""


class InputError(MinirtError, ValueError):
    """Inputs passed to Module.run do not match the module's inputs."""


class RunError(MinirtError):
    """The module's entry point reported an error."""


class ProfilingUnsupported(ModuleLoadError):
    """The module has no tether_run_profiled (built by an older crosscompile)."""

"""Errors the engine raises for bad input. Each message names the problem and the offending value."""


class InklingError(Exception):
    """Base class for every error this package raises on purpose."""


class ConfigError(InklingError, ValueError):
    """config.json is not a usable Inkling text config."""


class CheckpointError(InklingError, ValueError):
    """The safetensors files do not hold the tensors the config asks for."""


class RequestError(InklingError, ValueError):
    """A request (prompt or sampling parameters) cannot be served."""


class OptionError(InklingError, ValueError):
    """An engine option is out of its range (a batch size of 0, a bucket larger than the batch, ...)."""


class CompileError(InklingError, RuntimeError):
    """The compiled decode step cannot be built or would recompile after warm-up."""

"""inkling-compiled: a compiled decode engine for Inkling text models."""

from pathlib import Path as _Path

# An installed wheel carries custom_ops/ and graphs/ inside this package (setup.py package_dir).
# A source checkout run with PYTHONPATH=<repo> has them beside it: let the package find them there.
if not (_Path(__file__).parent / "custom_ops").is_dir():
    _root = _Path(__file__).resolve().parent.parent
    if (_root / "custom_ops" / "__init__.py").is_file():
        __path__.append(str(_root))  # noqa: F821 - package __path__

from .config import InklingConfig  # noqa: E402
from .engine import Engine  # noqa: E402
from .requests import RequestOutput  # noqa: E402
from .errors import CheckpointError, CompileError, ConfigError, InklingError, OptionError, RequestError  # noqa: E402
from .loading import load_model  # noqa: E402
from .sampling import SamplingParams  # noqa: E402

__all__ = ["Engine", "SamplingParams", "RequestOutput", "InklingConfig", "load_model", "InklingError", "ConfigError",
           "CheckpointError", "RequestError", "CompileError", "OptionError"]
__version__ = "0.1.0"

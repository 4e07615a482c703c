"""Type checks shared by everything that validates user input (config, sampling parameters, options)."""

from __future__ import annotations

import math
import numbers

from .errors import OptionError


def is_int(x) -> bool:
    """An integer (numpy's included), not a bool. A plain int is answered first: a prompt's ids are checked
    one by one, and the ABC check costs some twenty times as much."""
    return type(x) is int or (isinstance(x, numbers.Integral) and not isinstance(x, bool))


def is_finite(x) -> bool:
    """A finite real number (ints included), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def option_bool(name: str, value) -> bool:
    """An engine option that must be True or False (a truthy "no" is not False)."""
    if not isinstance(value, bool):
        raise OptionError(f"{name} must be True or False, got {value!r}")
    return value


def option_int(name: str, value, minimum: int = 1, maximum: int | None = None) -> int:
    """An engine option that must be an integer in minimum..maximum, or an OptionError naming it."""
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise OptionError(f"{name} must be an integer {bound}, got {value!r}")
    return int(value)

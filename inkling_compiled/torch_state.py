"""The torch global state an engine was built under, pinned around each of its steps.

Dynamo guards a compiled graph on global state (thread count, default dtype, autocast, deterministic
algorithms, the matmul precision flags): a caller that changes any of it after warm-up would make every
step recompile, which after warm-up is an error. So the engine records the state once and each step runs
under it: what differs is set for the step and restored afterwards. These settings are process-wide in
torch, so other threads see the engine's values while a step runs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

_AUTOCAST_DEVICES = ("cpu", "cuda")
_matmul = torch.backends.cuda.matmul


def _setter(obj, name: str) -> Callable[[Any], None]:
    return lambda value: setattr(obj, name, value)


# name -> (read the current value, set a value)
SETTINGS: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    "num_threads": (torch.get_num_threads, torch.set_num_threads),
    "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "deterministic": (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda value: torch.use_deterministic_algorithms(value[0], warn_only=value[1])),
    # Read through torch's C getters: the `torch.backends.cuda.matmul` attributes go through a Python
    # `__getattr__` that cost 10-14 us each at a step's start, run cold. The reduced-precision getters may
    # give (allowed, split-k) together, which the attribute's setter takes back whole.
    "allow_tf32": (torch._C._get_cublas_allow_tf32, _setter(_matmul, "allow_tf32")),
    "allow_fp16_reduce": (torch._C._get_cublas_allow_fp16_reduced_precision_reduction,
                          _setter(_matmul, "allow_fp16_reduced_precision_reduction")),
    "allow_bf16_reduce": (torch._C._get_cublas_allow_bf16_reduced_precision_reduction,
                          _setter(_matmul, "allow_bf16_reduced_precision_reduction")),
}
_NOTHING_TO_PIN = contextlib.nullcontext()


class PinnedTorchState:
    def __init__(self):
        self.values = {name: get() for name, (get, _) in SETTINGS.items()}
        self.autocast = {d: torch.is_autocast_enabled(d) for d in _AUTOCAST_DEVICES}

    def pinned(self) -> contextlib.AbstractContextManager:
        """Runs the body under the recorded state; when nothing differs (the usual case), a few getter calls
        and a context that does nothing."""
        differ = [(put, self.values[name], current) for name, (get, put) in SETTINGS.items()
                  if (current := get()) != self.values[name]]
        autocast = [(device, enabled) for device, enabled in self.autocast.items()
                    if torch.is_autocast_enabled(device) != enabled]
        return self._pinning(differ, autocast) if differ or autocast else _NOTHING_TO_PIN

    @staticmethod
    @contextlib.contextmanager
    def _pinning(differ: list, autocast: list):
        with contextlib.ExitStack() as stack:
            for put, value, current in differ:
                put(value)
                stack.callback(put, current)
            for device, enabled in autocast:
                stack.enter_context(torch.autocast(device, enabled=enabled))
            yield

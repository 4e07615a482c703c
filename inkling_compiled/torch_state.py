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
    "allow_tf32": (lambda: _matmul.allow_tf32, _setter(_matmul, "allow_tf32")),
    "allow_fp16_reduce": (lambda: _matmul.allow_fp16_reduced_precision_reduction,
                          _setter(_matmul, "allow_fp16_reduced_precision_reduction")),
    "allow_bf16_reduce": (lambda: _matmul.allow_bf16_reduced_precision_reduction,
                          _setter(_matmul, "allow_bf16_reduced_precision_reduction")),
}


class PinnedTorchState:
    def __init__(self):
        self.values = {name: get() for name, (get, _) in SETTINGS.items()}
        self.autocast = {d: torch.is_autocast_enabled(d) for d in _AUTOCAST_DEVICES}

    @contextlib.contextmanager
    def pinned(self):
        """Runs the body under the recorded state; costs a few getter calls when nothing differs."""
        with contextlib.ExitStack() as stack:
            for name, (get, put) in SETTINGS.items():
                current = get()
                if current != self.values[name]:
                    put(self.values[name])
                    stack.callback(put, current)
            for device, enabled in self.autocast.items():
                if torch.is_autocast_enabled(device) != enabled:
                    stack.enter_context(torch.autocast(device, enabled=enabled))
            yield

"""The torch global state an engine was built under, pinned around each of its steps.

Dynamo guards a compiled graph on global state (thread count, default dtype, autocast, deterministic
algorithms): a caller that changes any of it after warm-up would make every step recompile, which
after warm-up is an error. So the engine records the state once and each step runs under it: what
differs is set for the step and restored afterwards, and the caller's own code sees its own state.
"""

from __future__ import annotations

import contextlib

import torch

_AUTOCAST_DEVICES = ("cpu", "cuda")


class PinnedTorchState:
    def __init__(self):
        self.num_threads = torch.get_num_threads()
        self.default_dtype = torch.get_default_dtype()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.deterministic_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        self.autocast = {d: torch.is_autocast_enabled(d) for d in _AUTOCAST_DEVICES}

    @contextlib.contextmanager
    def pinned(self):
        """Runs the body under the recorded state; costs a few getter calls when nothing differs."""
        with contextlib.ExitStack() as stack:
            threads = torch.get_num_threads()
            if threads != self.num_threads:
                torch.set_num_threads(self.num_threads)
                stack.callback(torch.set_num_threads, threads)
            dtype = torch.get_default_dtype()
            if dtype != self.default_dtype:
                torch.set_default_dtype(self.default_dtype)
                stack.callback(torch.set_default_dtype, dtype)
            det = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
            if det != (self.deterministic, self.deterministic_warn_only):
                torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)
                stack.callback(torch.use_deterministic_algorithms, det[0], warn_only=det[1])
            for device, enabled in self.autocast.items():
                if torch.is_autocast_enabled(device) != enabled:
                    stack.enter_context(torch.autocast(device, enabled=enabled))
            yield

"""The ranks of a tensor-parallel engine as rank 0 sees them: the processes, the process groups and the
channel step plans go out on.

Rank 0 schedules. Before each forward it sends the step plan (`step_plan.StepPlan`, msgpack) on a gloo
control group: the pool writes it made since the last one, the prefix checkpoints the forward takes and
which forward it is. The other ranks replay the writes on their own shards and execute the same plan;
the collectives inside the forward (`group.TensorParallel`) run on the compute group (gloo on CPU, NCCL
on GPU). Every rank samples from the same gathered logits, so the tokens rank 0 computes are everyone's
and nothing comes back.

On the control group the other ranks wait for rank 0 without a deadline (an engine may idle for hours);
rank 0's sends there, and the compute group's collectives, time out (`timeout`): that is how a hung
rank surfaces.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import struct
import subprocess
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..errors import InklingError

log = logging.getLogger("inkling_compiled")

_IDLE = timedelta(days=365)  # the control group: workers wait this long for the next step
_LOOPBACK = "lo0" if sys.platform == "darwin" else "lo"
_HEAD = struct.Struct("<QQ")  # header bytes, data bytes


class ParallelError(InklingError, RuntimeError):
    """A rank of a tensor-parallel engine died, hung or failed a step; every rank has been stopped."""


class StepChannel:
    """Messages from rank 0 to every other rank over `group`: a pickled header and a byte array, in one
    broadcast of CAPACITY bytes (a second one carries whatever does not fit, prefill metadata of long
    chunks)."""

    CAPACITY = 32 * 1024

    def __init__(self, group, timeout: float):
        self.group, self.timeout = group, timeout
        self.frame = torch.zeros(self.CAPACITY, dtype=torch.uint8)

    def _broadcast(self, tensor: torch.Tensor, timeout: float | None) -> None:
        """From rank 0, waiting at most `timeout` seconds for every rank to take it (a broadcast completes
        when the others receive it: a rank that hangs would hold rank 0 forever on the control group)."""
        work = dist.broadcast(tensor, src=0, group=self.group, async_op=True)
        work.wait(timedelta(seconds=self.timeout if timeout is None else timeout))

    def send(self, header: dict, data: bytes | None = None, timeout: float | None = None) -> None:
        head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        body = b"" if data is None else bytes(data)
        message = _HEAD.pack(len(head), len(body)) + head + body
        view = self.frame.numpy()
        first = min(len(message), self.CAPACITY)
        view[:first] = np.frombuffer(message, dtype=np.uint8, count=first)
        self._broadcast(self.frame, timeout)
        if len(message) > self.CAPACITY:
            rest = torch.from_numpy(np.frombuffer(message, dtype=np.uint8)[self.CAPACITY:].copy())
            self._broadcast(rest, timeout)

    def receive(self) -> tuple[dict, np.ndarray]:
        dist.broadcast(self.frame, src=0, group=self.group)
        n_head, n_body = _HEAD.unpack(self.frame.numpy()[:_HEAD.size].tobytes())
        total = _HEAD.size + n_head + n_body
        message = self.frame.numpy()[:min(total, self.CAPACITY)]
        if total > self.CAPACITY:
            rest = torch.empty(total - self.CAPACITY, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            message = np.concatenate([message, rest.numpy()])
        header = pickle.loads(message[_HEAD.size:_HEAD.size + n_head].tobytes())
        return header, message[_HEAD.size + n_head:total]

    @staticmethod
    def gather(value) -> list | None:
        """Every rank's `value`, on rank 0 (None elsewhere). On the compute group: a reply has the step
        timeout, so a rank that hangs fails the gather instead of blocking rank 0."""
        out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(value, out, dst=0)
        return out


class Ranks:
    """This process's place among the ranks: the groups, the channel and (rank 0 of a spawned set) the
    worker processes. `close()` stops them all; it is safe to call more than once."""

    def __init__(self, world: int, rank: int, timeout: float, procs: list | None = None,
                 rendezvous: str | None = None):
        self.world, self.rank, self.timeout = world, rank, timeout
        self.compute_group, self.channel = "", None  # set by `connect`
        self.procs = procs or []
        self._rendezvous = rendezvous
        self._owns_group = False  # whether this engine made the default group (else torchrun or the caller did)
        self._excepthook = sys.excepthook  # init_process_group installs a "[rankN]:" one; close puts it back
        self.closed = False

    def connect(self, backend: str, **init) -> "Ranks":
        """Joins (or makes) the compute group and makes the control group beside it."""
        if not dist.is_initialized():
            # Ranks spawned on this machine talk over loopback, whatever the host name resolves to; the
            # caller's environment is left as it was.
            previous = os.environ.get("GLOO_SOCKET_IFNAME")
            if self.procs:
                os.environ["GLOO_SOCKET_IFNAME"] = previous or _LOOPBACK
            try:
                dist.init_process_group(backend, timeout=timedelta(seconds=self.timeout), **init)
            finally:
                if previous is None:
                    os.environ.pop("GLOO_SOCKET_IFNAME", None)
            self._owns_group = True
        self.compute_group = dist.group.WORLD.group_name
        self.channel = StepChannel(dist.new_group(backend="gloo", timeout=_IDLE), self.timeout)
        return self

    def dead(self) -> str | None:
        """Which spawned worker has exited, and how; None while they all run."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"tensor-parallel rank {rank} (pid {proc.pid}) {how}"
        return None

    def check(self) -> None:
        if (reason := self.dead()) is not None:
            raise ParallelError(reason)

    def close(self, graceful: bool = True) -> None:
        """Asks the other ranks to stop (graceful) and waits for the spawned ones; any still running after
        a few seconds are killed. Then the process groups are destroyed, so another engine may start."""
        if self.closed:
            return
        self.closed = True
        if graceful and self.channel is not None and self.dead() is None:
            try:
                self.channel.send({"op": "close"}, timeout=min(self.timeout, 10.0))
            except Exception:  # a broken group: the workers are stopped below
                log.debug("close message not delivered", exc_info=True)
        deadline = time.monotonic() + (10.0 if graceful else 0.0)
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                try:
                    proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    log.warning("tensor-parallel worker %d did not exit after SIGKILL", proc.pid)
        if dist.is_initialized():
            try:  # a group torchrun or the caller made is theirs: only the control group goes
                dist.destroy_process_group(None if self._owns_group else self.channel.group)
            except Exception:
                log.debug("destroying the process group failed", exc_info=True)
        sys.excepthook = self._excepthook
        if self._rendezvous:
            shutil.rmtree(self._rendezvous, ignore_errors=True)

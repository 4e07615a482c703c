"""The ranks of a tensor-parallel engine: how they start, how the scheduling rank tells the others what
to run, and how they stop.

Rank 0 schedules. Before each forward it sends one message (`StepChannel`) on a gloo control group:
the pool writes it made since the last one (`StatePool.journal`: slot resets, freed block rows,
restored prefix checkpoints), the prefix checkpoints the forward takes, the step's prepared metadata
bytes and which forward it is (prefill, decode or verify, and the bucket). The other ranks apply it to
their own shards and run the same forward; the collectives inside it (`group.TensorParallel`) run on
the compute group (gloo on CPU, NCCL on GPU). Every rank samples from the same gathered logits, so the
tokens rank 0 computes are everyone's and nothing comes back.

On the control group the other ranks wait for rank 0 without a deadline (an engine may idle for hours);
rank 0's sends there, and the compute group's collectives, time out (`timeout`): that is how a hung
rank surfaces. A rank that dies is seen before
the next step (spawned workers) or by the broken collective, and the engine then stops every rank.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..errors import InklingError, OptionError

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

    def send(self, header: dict, data: np.ndarray | None = None, timeout: float | None = None) -> None:
        head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        body = b"" if data is None else data.tobytes()
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


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_ADDR" in os.environ)


def join(world: int, device: torch.device, timeout: float) -> Ranks:
    """This process's rank in a group torchrun (or the caller) set up; `world` must be its size."""
    ranks = Ranks(world, -1, timeout)
    ranks.connect(_backend(device), init_method="env://")
    if dist.get_world_size() != world:
        ranks.close(graceful=False)
        raise OptionError(f"tensor_parallel_size={world}, but the process group has {dist.get_world_size()} ranks")
    ranks.rank = dist.get_rank()
    return ranks


def spawn(world: int, device: torch.device, timeout: float, worker_args: tuple) -> Ranks:
    """Starts ranks 1..world-1 as processes on this machine (each runs `worker_main`) and joins them as
    rank 0. A worker that cannot start is reported with its exit code.

    Fresh interpreters (`python -c`), not multiprocessing's spawn, so the caller's main module is never
    re-imported: a script without an `if __name__ == "__main__"` guard works, and so do REPLs and pytest."""
    if dist.is_initialized():
        raise OptionError("a torch.distributed process group is already running in this process: launch with "
                          "torchrun (every rank runs the script) or close the other engine first")
    if device.type == "cuda" and (device.index or 0) + world > torch.cuda.device_count():
        raise OptionError(f"tensor_parallel_size={world} from {device} needs devices up to cuda:"
                          f"{(device.index or 0) + world - 1}; this machine has {torch.cuda.device_count()}")
    rendezvous = tempfile.mkdtemp(prefix="inkling-tp-")
    init = f"file://{os.path.join(rendezvous, 'store')}"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", _LOOPBACK)}
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    procs = []
    for rank in range(1, world):
        args = pickle.dumps((rank, world, init, timeout, os.getpid(), torch.get_num_threads(), *worker_args))
        proc = subprocess.Popen([sys.executable, "-c", _WORKER_ENTRY], stdin=subprocess.PIPE, env=env)
        proc.stdin.write(args)
        proc.stdin.close()
        procs.append(proc)
    ranks = Ranks(world, 0, timeout, procs, rendezvous)
    try:
        _wait_until_ready(ranks, rendezvous, timeout)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        ranks.connect(_backend(device), init_method=init, rank=0, world_size=world)
    except BaseException as e:
        ranks.close(graceful=False)
        raise ParallelError(f"the tensor-parallel ranks did not start: {ranks.dead() or e}") from e
    return ranks


_WORKER_ENTRY = ("import pickle, sys; from inkling_compiled.parallel.runtime import worker_main; "
                 "worker_main(*pickle.load(sys.stdin.buffer))")


def _ready_file(rendezvous: str, rank: int) -> str:
    return os.path.join(rendezvous, f"ready.{rank}")


def _wait_until_ready(ranks: Ranks, rendezvous: str, timeout: float) -> None:
    """Until every spawned rank has started (its interpreter and torch loaded): a rank that cannot start is
    reported at once, not after the process group's timeout."""
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(_ready_file(rendezvous, r)) for r in range(1, ranks.world)):
        ranks.check()
        if time.monotonic() > deadline:
            raise ParallelError(f"the tensor-parallel ranks did not start within {timeout:g} s")
        time.sleep(0.05)


def _exit_with_parent(parent: int) -> None:
    """A spawned worker must not outlive rank 0 (killed without a chance to stop it)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="inkling-tp-parent-watch", daemon=True).start()


def worker_main(rank: int, world: int, init: str, timeout: float, parent: int, threads: int, path, device: str,
                load_options: dict, engine_options: dict) -> None:
    """A spawned rank: loads its shard, builds the same engine, serves steps until rank 0 closes it. It runs
    as many torch threads as rank 0."""
    _exit_with_parent(parent)
    torch.set_num_threads(threads)
    device = torch.device(device)
    if device.type == "cuda":  # rank r takes the r-th device after rank 0's
        device = torch.device("cuda", (device.index or 0) + rank)
        torch.cuda.set_device(device)
    try:
        open(_ready_file(os.path.dirname(init.removeprefix("file://")), rank), "w").close()
        ranks = Ranks(world, rank, timeout).connect(_backend(device), init_method=init, rank=rank, world_size=world)
        serve_rank(ranks, path, device, load_options, engine_options)
    except BaseException as e:
        if os.getppid() != parent:  # rank 0 is gone: the broken group says nothing new
            os._exit(3)
        if isinstance(e, InklingError):  # an option or checkpoint error: rank 0 reports the same one
            print(f"tensor-parallel rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        else:
            log.exception("tensor-parallel rank %d failed", rank)
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def serve_rank(ranks: Ranks, path, device, load_options: dict, engine_options: dict) -> None:
    """A rank other than 0: its shard of the engine, running what rank 0 sends until it says close."""
    from ..engine import Engine
    from ..loading import load_model

    model, _ = load_model(path, device=device, tensor_parallel=(ranks.rank, ranks.world, ranks.compute_group),
                          **load_options)
    engine = Engine(model, device=device, ranks=ranks, **{**engine_options, "progress": False})
    serve(engine, ranks.channel)
    ranks.close(graceful=False)


def serve(engine, channel: StepChannel) -> None:
    """The other ranks' loop: apply rank 0's pool writes and step metadata, run the forward it names."""
    pool, backend = engine.pool, engine.backend
    while True:
        header, data = channel.receive()
        op = header["op"]
        if op == "close":
            return
        if op == "step":
            for effect, args in header["journal"]:
                if effect not in pool.EFFECTS:
                    raise ParallelError(f"unknown pool effect {effect!r} from rank 0")
                getattr(pool, effect)(*args)
            backend.buffers.load(header["step"], data)
            backend.context.checkpoints = header["checkpoints"]
            try:
                with engine.torch_state.pinned():
                    engine.runner.replay(header["kind"], header["bucket"], header["slots"])
            finally:
                backend.context.checkpoints = []
        elif op == "warm_up":
            engine.warm_up(header["buckets"])
        elif op == "report":
            StepChannel.gather(engine.rank_report())
        else:
            raise ParallelError(f"unknown message {op!r} from rank 0")


class StepMirror:
    """Rank 0's side of `serve`: sends each forward, with what the pool wrote since the last one."""

    def __init__(self, ranks: Ranks, pool, backend):
        self.ranks, self.pool, self.backend = ranks, pool, backend
        pool.journal = []

    in_step = False  # between sending a forward and its end: a failure then leaves the ranks out of step

    def publish(self, kind: str, bucket: int | None, slots: list[int] | None) -> None:
        self.ranks.check()
        self.in_step = True
        step, data = self.backend.buffers.export()
        journal, self.pool.journal = self.pool.journal, []
        self.ranks.channel.send({"op": "step", "kind": kind, "bucket": bucket, "slots": slots, "journal": journal,
                                 "checkpoints": list(self.backend.context.checkpoints), "step": step}, data)

    def warm_up(self, buckets) -> None:
        self.ranks.check()
        self.in_step = True  # the other ranks compile and run the same warm-up steps
        self.ranks.channel.send({"op": "warm_up", "buckets": buckets})

    def reports(self, own: dict) -> list[dict]:
        self.ranks.check()
        self.in_step = True
        self.ranks.channel.send({"op": "report"})
        reports = StepChannel.gather(own)
        self.in_step = False
        return reports

"""The ranks of a tensor-parallel engine: how they start, and the loop the other ranks run (`serve`).

Rank 0 spawns ranks 1.. as fresh interpreters on this machine (or joins the group torchrun started);
each loads its shard, builds a `Worker` and executes the step plans rank 0 sends (`ranks.py` holds the
channel and the process groups). A rank that dies is seen before the next step (spawned workers) or by
the broken collective, and the engine then stops every rank.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time

import msgspec
import torch
import torch.distributed as dist

from ..errors import InklingError, OptionError
from ..step_plan import StepPlan
from ..worker import Worker
from .ranks import _LOOPBACK, ParallelError, Ranks, StepChannel

log = logging.getLogger("inkling_compiled")


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
                load_options: dict, worker_options: dict) -> None:
    """A spawned rank: loads its shard, builds its Worker, serves steps until rank 0 closes it. It runs
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
        serve_rank(ranks, path, device, load_options, worker_options)
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


def serve_rank(ranks: Ranks, path, device, load_options: dict, worker_options: dict) -> None:
    """A rank other than 0: its shard of the model in a Worker, running what rank 0 sends until it says close."""
    from ..loading import load_model

    model, _ = load_model(path, device=device, tensor_parallel=(ranks.rank, ranks.world, ranks.compute_group),
                          **load_options)
    options = dict(worker_options)
    warmup = options.pop("warmup", True)
    worker = Worker(model, device=device, tensor_parallel=True, **options)
    if warmup:
        worker.warm_up()
    serve(worker, ranks.channel, ranks.rank)
    ranks.close(graceful=False)


def serve(worker: Worker, channel: StepChannel, rank: int) -> None:
    """The other ranks' loop: replay rank 0's pool writes, execute the plan it sent."""
    while True:
        header, data = channel.receive()
        op = header["op"]
        if op == "close":
            return
        if op == "step":
            plan = msgspec.msgpack.decode(data.tobytes(), type=StepPlan)
            worker.apply_journal(plan.journal)
            worker.execute(plan, to_host=False)
        elif op == "warm_up":
            worker.warm_up(header["buckets"])
        elif op == "report":
            StepChannel.gather(worker.rank_report(rank))
        else:
            raise ParallelError(f"unknown message {op!r} from rank 0")

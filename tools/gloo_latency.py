"""gloo all-reduce latency between two processes of this machine (loopback), one thread each, and what
the alternative it is weighed against costs: one short-conv decode call over the full hidden of `small`.

    OMP_NUM_THREADS=1 python tools/gloo_latency.py

The first is the floor under every collective of a tensor-parallel step on CPU; the two together are why
the attention-output and MLP-output convs stay replicated rather than sharded with a gather (see the
README's Several devices).
"""

import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def main(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for n in (64, 512, 4096):
        x = torch.randn(n)
        for _ in range(50):
            dist.all_reduce(x)
        t = time.perf_counter()
        for _ in range(500):
            dist.all_reduce(x)
        if rank == 0:
            print(f"{n:5d} floats: {(time.perf_counter() - t) / 500 * 1e6:7.1f} us per all-reduce", flush=True)
    dist.destroy_process_group()


def conv_cost(hidden: int = 512, kernel: int = 4, slots: int = 32) -> None:
    from inkling_compiled import custom_ops  # noqa: F401  (registers torch.ops.inkling)

    torch.set_num_threads(1)
    for batch in (1, 8):
        x, weight = torch.randn(batch, hidden), torch.randn(hidden, kernel)
        state = torch.zeros(slots + 1, kernel - 1, hidden)
        rows = torch.arange(1, batch + 1, dtype=torch.int32)
        for _ in range(100):
            torch.ops.inkling.sconv_decode(x, state, weight, rows)
        t = time.perf_counter()
        for _ in range(2000):
            torch.ops.inkling.sconv_decode(x, state, weight, rows)
        print(f"sconv_decode, hidden {hidden}, batch {batch}: {(time.perf_counter() - t) / 2000 * 1e6:7.1f} us per call")


if __name__ == "__main__":
    conv_cost()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(main, args=(2, free), nprocs=2)

"""gloo all-reduce latency between two processes of this machine (loopback), one thread each.

    OMP_NUM_THREADS=1 python tools/gloo_latency.py

The floor under every collective of a tensor-parallel step on CPU (see the README's Several devices).
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


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(main, args=(2, free), nprocs=2)

"""Achieved memory bandwidth of the decode kernels against the device's own copy bandwidth, and the
prefill attention's rate against the device's bf16 matrix rate.

    python3 tools/bench_kernels.py [--device cuda] [--dtype bfloat16]

paged_attention: B rows of one global layer (Inkling-Small-like heads), each reading its own pages of
a long context; bytes = the K and V rows the rows cover. moe_experts: a decode batch routed top-k over
E experts; bytes = the weights of the experts chosen (each read once), plus activations. linear_int8:
a few rows over an int8 [O, H] weight; bytes = the int8 weight and its scales, beside cuBLAS reading
the same weight in the engine's dtype. extend_attention: one prompt's chunk attending causally to
itself, global and sliding; FLOPs = the two products over the keys each query may see. The copy
reference is a device-to-device copy of 1 GiB, the matrix reference an 8192^3 product. On CPU
(interpreted Triton) it only checks that it runs.
"""

import argparse
import time

import torch

from inkling_compiled.custom_ops import KERNELS


def timed(fn, device, reps: int) -> float:
    """Seconds per call (median of reps, after a warm call)."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device, reps: int) -> float:
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    return 2 * n / timed(lambda: dst.copy_(src), device, reps)  # read + write


def paged_attention_case(device, dtype, rows: int, context: int):
    nh, nkv, hd, page, E = 32, 8, 128, 16, 256
    pages_per_row = -(-context // page)
    total_pages = rows * pages_per_row + 1
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(total_pages * page, nkv, hd, device=device, dtype=dtype, generator=g)
    v = torch.randn_like(k)
    q = torch.randn(rows, nh, hd, device=device, dtype=dtype, generator=g)
    table = torch.randn(rows, nh, E, device=device, dtype=dtype, generator=g)
    block_table = (1 + torch.randperm(total_pages - 1, device=device)[: rows * pages_per_row]).view(rows, -1).int()
    idx = torch.arange(rows, device=device, dtype=torch.int32)
    lens = torch.full((rows,), context, device=device, dtype=torch.int32)
    args = (q, k, v, table, None, block_table, idx, lens, page, E)
    moved = 2 * rows * context * nkv * hd * k.element_size()
    return args, moved


def moe_case(device, dtype, rows: int):
    E, k, H, I = 64, 8, 2048, 1024
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, H, device=device, dtype=dtype, generator=g)
    ids = torch.stack([torch.randperm(E, device=device, generator=g)[:k] for _ in range(rows)])
    w = torch.rand(rows, k, device=device, generator=g).to(dtype)
    gate_up = torch.randn(E, 2 * I, H, device=device, dtype=dtype, generator=g) / 40
    down = torch.randn(E, H, I, device=device, dtype=dtype, generator=g) / 40
    chosen = ids.unique().numel()
    moved = chosen * 3 * I * H * gate_up.element_size()
    return (x, ids, w, gate_up, down), moved


def matmul_rate(device, dtype, reps: int) -> float:
    n = 8192 if device.type == "cuda" else 64
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / timed(lambda: a @ b, device, reps)


def linear_int8_case(device, dtype, rows: int, out_features: int, in_features: int):
    g = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(rows, in_features, device=device, dtype=dtype, generator=g)
    q = torch.randint(-127, 128, (out_features, in_features), device=device, dtype=torch.int8, generator=g)
    scale = torch.rand(out_features, device=device, generator=g) / 100 + 1e-3
    dense = (q.float() * scale[:, None]).to(dtype)
    moved = q.numel() + 4 * out_features
    return (x, q, scale), (x, dense), moved


def extend_case(device, dtype, tokens: int, window: int):
    nh, nkv, hd, E = 32, 8, 128, 256
    g = torch.Generator(device=device).manual_seed(3)
    q = torch.randn(tokens, nh, hd, device=device, dtype=dtype, generator=g)
    k = torch.randn(tokens, nkv, hd, device=device, dtype=dtype, generator=g)
    v = torch.randn_like(k)
    table = torch.randn(tokens, nh, E, device=device, dtype=dtype, generator=g)
    starts = torch.tensor([0, tokens], device=device, dtype=torch.int32)
    seen = sum(min(i + 1, window) if window else i + 1 for i in range(tokens))  # keys each query attends
    flops = 4 * seen * nh * hd  # q.k and p.v
    return (q, k, v, table, None, starts, starts, window, E), flops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    small = device.type != "cuda"  # interpreted: tiny shapes, a smoke run
    peak = copy_bandwidth(device, a.reps)
    print(f"device copy bandwidth: {peak / 1e9:.0f} GB/s")
    for rows, context in ([(1, 64)] if small else [(1, 32768), (8, 8192), (32, 4096), (64, 2048)]):
        args, moved = paged_attention_case(device, dtype, rows, context)
        s = timed(lambda: KERNELS["paged_attention"]["CUDA"](*args), device, a.reps)
        print(f"paged_attention rows={rows:3d} context={context:6d}: {s * 1e6:8.1f} us  "
              f"{moved / s / 1e9:7.0f} GB/s  ({moved / s / peak:.2f} of copy)", flush=True)
    for rows in ([1] if small else [1, 8, 32]):
        args, moved = moe_case(device, dtype, rows)
        s = timed(lambda: KERNELS["moe_experts"]["CUDA"](*args), device, a.reps)
        print(f"moe_experts rows={rows:3d}: {s * 1e6:8.1f} us  {moved / s / 1e9:7.0f} GB/s  "
              f"({moved / s / peak:.2f} of copy)", flush=True)
    O, H = (256, 128) if small else (8192, 4096)
    for rows in ([1] if small else [1, 8, 32]):
        int8_args, dense_args, moved = linear_int8_case(device, dtype, rows, O, H)
        s = timed(lambda: KERNELS["linear_int8"]["CUDA"](*int8_args), device, a.reps)
        dense = timed(lambda: torch.nn.functional.linear(*dense_args), device, a.reps)
        print(f"linear_int8 rows={rows:3d} {O}x{H}: {s * 1e6:8.1f} us  {moved / s / 1e9:7.0f} GB/s  "
              f"({moved / s / peak:.2f} of copy; cuBLAS {a.dtype} {dense * 1e6:.1f} us, {dense / s:.2f}x)",
              flush=True)
    rate = matmul_rate(device, dtype, a.reps)
    print(f"device {a.dtype} matmul: {rate / 1e12:.0f} TFLOP/s")
    for tokens, window in ([(40, 0)] if small else [(2048, 0), (8192, 0), (8192, 512)]):
        args, flops = extend_case(device, dtype, tokens, window)
        s = timed(lambda: KERNELS["extend_attention"]["CUDA"](*args), device, a.reps)
        print(f"extend_attention tokens={tokens:5d} window={window:4d}: {s * 1e6:8.1f} us  "
              f"{flops / s / 1e12:6.1f} TFLOP/s  ({flops / s / rate:.2f} of matmul)", flush=True)


if __name__ == "__main__":
    main()

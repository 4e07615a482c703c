"""Compiles every Triton kernel, as the launchers call it, for a GPU this machine need not have.

    python tools/aot_triton.py [--arch 90] [--jobs 2]     (90: Hopper, the H100/H200; 80: Ampere)

The interpreter that runs the kernels in CI executes Python, not Triton's compiler: a kernel can pass
every interpreted test and still not compile (a non-constexpr global, a dtype tl.dot refuses, a
construct the code generator rejects). This runs each launcher of `custom_ops/gpu` on small CPU
tensors with its kernels replaced by a recorder, then compiles each distinct launch (argument types,
constexprs) ahead of time for the target with the installed triton and its bundled ptxas, in a fresh
cache. One line per kernel variant; exit status 1 if any fails. Run without TRITON_INTERPRET. With
`--jobs N` the variants are dealt round-robin to N processes (Triton's compiler is single-threaded).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time

import torch

POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
           torch.int64: "*i64", torch.bool: "*i1", torch.int8: "*i8"}
MODULES = ("sconv", "kv", "attention", "extend", "moe", "sampling", "linear")


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **constexprs)` records the launch."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            types = {}
            for name, value in zip([n for n in self.kernel.arg_names if n not in constexprs], args):
                if isinstance(value, torch.Tensor):
                    types[name] = POINTER[value.dtype]
                elif isinstance(value, float):
                    types[name] = "fp32"
                else:
                    types[name] = "i32" if -2**31 <= int(value) < 2**31 else "i64"
            self.launches.append((self.kernel, types, constexprs))
        return launch


def sample_launches() -> list:
    """Every launcher on small inputs, fp32 and bf16 where the model's dtype reaches it."""
    import triton

    launches: list = []
    gpu = {name: importlib.import_module(f"inkling_compiled.custom_ops.gpu.{name}") for name in MODULES}
    for module in gpu.values():
        for attr, value in list(vars(module).items()):
            if isinstance(value, triton.runtime.jit.JITFunction) and "_kernel" in attr:
                setattr(module, attr, Recorder(value, launches))
    i32 = dict(dtype=torch.int32)
    for K in (2, 3, 4):
        state, w = torch.zeros(4, K - 1, 40), torch.zeros(40, K)
        gpu["sconv"].sconv_decode(torch.zeros(3, 40), state, w, torch.zeros(3, **i32))
        gpu["sconv"].sconv_extend(torch.zeros(5, 40), state, w, torch.tensor([0, 2, 5], **i32),
                                  torch.tensor([True, False]), torch.zeros(2, **i32))
        windows = torch.zeros(4, 3, K - 1, 40)
        gpu["sconv"].sconv_verify(torch.zeros(6, 40), state, w, torch.zeros(2, **i32), windows)
        gpu["sconv"].commit_conv_windows([state], [windows], torch.zeros(2, **i32),
                                         torch.zeros(2, dtype=torch.int64))
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.zeros(64, 2, 16, dtype=dtype)
        gpu["kv"].kv_write(cache, cache.clone(), torch.zeros(3, 2, 16, dtype=dtype), torch.zeros(3, 2, 16, dtype=dtype),
                           torch.zeros(3, dtype=torch.int64))
        for nh, nkv, hd in ((8, 1, 64), (32, 8, 128), (6, 2, 80)):
            q, table = torch.zeros(2, nh, hd, dtype=dtype), torch.zeros(2, nh, 16, dtype=dtype)
            kc = torch.zeros(64, nkv, hd, dtype=dtype)
            for tau in (None, torch.ones(2)):
                gpu["attention"].paged_attention(q, kc, kc.clone(), table, tau, torch.zeros(3, 4, **i32),
                                                 torch.zeros(2, **i32), torch.ones(2, **i32), 16, 16)
            gpu["attention"].ring_attention(q, kc, kc.clone(), table, torch.zeros(2, dtype=torch.int64),
                                            torch.zeros(2, **i32), 8, 16)
        x = torch.zeros(3, 48, dtype=dtype)
        gate_up = torch.zeros(4, 80, 48, dtype=dtype)
        gpu["moe"].moe_experts(x, torch.tensor([[0, 1], [1, 2], [3, 0]]), torch.ones(3, 2, dtype=dtype), gate_up,
                               torch.zeros(4, 48, 40, dtype=dtype))
        # int8 weights (quantization="int8"): the experts and the projections
        i8 = dict(dtype=torch.int8)
        gpu["moe"].moe_experts_int8(x, torch.tensor([[0, 1], [1, 2], [3, 0]]), torch.ones(3, 2, dtype=dtype),
                                    torch.zeros(4, 80, 48, **i8), torch.ones(4, 80), torch.zeros(4, 48, 40, **i8),
                                    torch.ones(4, 48))
        gpu["linear"].linear_int8(x, torch.zeros(40, 48, **i8), torch.ones(40))
    # Prompt attention: one head layout per dtype (its variants take seconds each to compile).
    for dtype, (nh, nkv, hd) in ((torch.float32, (8, 1, 64)), (torch.bfloat16, (6, 2, 80))):
        q, table = torch.zeros(2, nh, hd, dtype=dtype), torch.zeros(2, nh, 16, dtype=dtype)
        kv = torch.zeros(4, nkv, hd, dtype=dtype)
        starts = torch.tensor([0, 2])
        for tau, window in ((None, 8), (torch.ones(2), 0)):  # sliding layers, global layers with the log scale
            gpu["extend"].extend_attention(q, kv, kv.clone(), table, tau, starts, starts, window, 16)
    gpu["sampling"].top_k_top_p(torch.zeros(2, 3000), torch.tensor([0, 5]), torch.tensor([1.0, 0.5]))
    return launches


def distinct_launches() -> list[tuple]:
    """Each distinct (kernel, argument types, constexprs) the launchers make, in launch order."""
    seen, out = set(), []
    for kernel, types, constexprs in sample_launches():
        key = (kernel.fn.__name__, tuple(sorted(types.items())), tuple(sorted(constexprs.items())))
        if key not in seen:
            seen.add(key)
            out.append((kernel, types, constexprs))
    return out


def run_shards(jobs: int, arch: int) -> int:
    """This script once per shard, side by side; their lines, then one total."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, __file__, "--arch", str(arch), "--shard", str(i), "--jobs", str(jobs)],
                              stdout=subprocess.PIPE, text=True) for i in range(jobs)]
    import re

    variants = failed = 0
    for i, proc in enumerate(procs):
        out, _ = proc.communicate()
        lines = out.splitlines()
        total = re.fullmatch(r"(\d+) kernel variants, (\d+) failed", lines[-1]) if lines else None
        print("\n".join(lines[:-1] if total else lines), flush=True)
        if total is None:  # the shard died before its total: count it as a failure
            print(f"FAIL shard {i} exited with status {proc.returncode} before its total", flush=True)
            failed += 1
            continue
        variants, failed = variants + int(total[1]), failed + int(total[2])
    print(f"{variants} kernel variants, {failed} failed")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--jobs", type=int, default=1, help="processes compiling side by side")
    p.add_argument("--shard", type=int, default=None, help=argparse.SUPPRESS)  # one process's share
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: the interpreter replaces the compiler")
    if args.jobs > 1 and args.shard is None:
        return run_shards(args.jobs, args.arch)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="inkling-aot-")  # compile, never load
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launches = distinct_launches()
    mine = launches if args.shard is None else launches[args.shard::args.jobs]
    failed = 0
    for kernel, types, constexprs in mine:
        signature = {name: "constexpr" if name in constexprs else types[name] for name in kernel.arg_names}
        label = f"{kernel.fn.__name__} {' '.join(f'{k}={v}' for k, v in sorted(constexprs.items()))} " \
                f"{sorted(set(t for t in types.values() if t.startswith('*')))}"
        t0 = time.perf_counter()
        try:
            triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", args.arch, 32))
            print(f"ok   sm_{args.arch} {label} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as e:  # report every variant, then fail
            failed += 1
            print(f"FAIL sm_{args.arch} {label}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}",
                  flush=True)
    print(f"{len(mine)} kernel variants, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

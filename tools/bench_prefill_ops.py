"""The prefill chunk's own ops at one chunk length: `extend_attention` on a global and a sliding layer,
and the routed experts, each with the shapes of a tiny config, against its reference.

    OMP_NUM_THREADS=1 python tools/bench_prefill_ops.py [--config small] [--tokens 1024]

One sequence's chunk with no history; random inputs (the experts' routing uniform). Best of `--reps`
calls after one untimed; "useful GFLOP/s" counts the attention's causal (or windowed) pairs only, the
experts' GEMMs only. Nothing here asserts a speed.
"""

import argparse

import torch

from inkling_compiled import custom_ops  # noqa: F401  (registers torch.ops.inkling)
from inkling_compiled.config import InklingConfig
from inkling_compiled.custom_ops.attention import extend_attention_reference
from inkling_compiled.custom_ops.moe import moe_experts_reference
from inkling_compiled.floor import best_seconds
from inkling_compiled.tiny import TINY_CONFIGS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small", choices=sorted(TINY_CONFIGS))
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    config = InklingConfig.from_dict({"model_type": "inkling_text", **TINY_CONFIGS[args.config]})
    g = torch.Generator().manual_seed(0)
    T = args.tokens
    qsl = ksl = torch.tensor([0, T])
    print(f"{args.config}, one {T}-token chunk, {torch.get_num_threads()} thread(s)")
    print("| op | kernel ms | reference ms | reference / kernel | useful GFLOP/s |")
    print("|---|---|---|---|---|")
    layers = [config.geometry(i).sliding for i in range(config.num_hidden_layers)]
    for layer_id in (layers.index(False), layers.index(True)):  # the first global and sliding layers
        geo = config.geometry(layer_id)
        q = torch.randn(T, geo.num_heads, geo.head_dim, generator=g)
        k, v = (torch.randn(T, geo.num_kv_heads, geo.head_dim, generator=g) for _ in range(2))
        table = torch.randn(T, geo.num_heads, geo.rel_extent, generator=g)
        tau = torch.rand(T, generator=g) + 0.5 if geo.log_scaling else None
        call = (q, k, v, table, tau, qsl, ksl, geo.window or 0, geo.rel_extent)
        ours = best_seconds(lambda: torch.ops.inkling.extend_attention(*call), args.reps)
        ref = best_seconds(lambda: extend_attention_reference(*call), max(1, args.reps // 2))
        pairs = sum(min(i + 1, geo.window) if geo.window else i + 1 for i in range(T))
        flops = 4 * pairs * geo.num_heads * geo.head_dim
        kind = "sliding" if geo.sliding else "global"
        print(f"| extend_attention, {kind} layer {layer_id} | {ours * 1e3:.2f} | {ref * 1e3:.2f} | "
              f"{ref / ours:.1f}x | {flops / ours / 1e9:.1f} |")
    E, k_top = config.n_routed_experts, config.num_experts_per_tok
    H, I = config.hidden_size, config.moe_intermediate_size
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k_top] for _ in range(T)])
    weights = torch.rand(T, k_top, generator=g)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5, torch.randn(E, H, I, generator=g) / I ** 0.5
    call = (x, ids, weights, gate_up, down)
    ours = best_seconds(lambda: torch.ops.inkling.moe_experts(*call), args.reps)
    ref = best_seconds(lambda: moe_experts_reference(*call), max(1, args.reps // 2))
    flops = 2 * T * k_top * 3 * H * I
    print(f"| moe_experts ({E} experts, top {k_top}) | {ours * 1e3:.2f} | {ref * 1e3:.2f} | {ref / ours:.1f}x | "
          f"{flops / ours / 1e9:.1f} |")


if __name__ == "__main__":
    main()

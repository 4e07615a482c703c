"""Host torch ops per decode step, from a trace of `inkling-compiled profile`: the top-level aten and inkling
ops each engine step makes outside its graph replays (each such op runs cold, after the replay has swept
the caches, so their count is a noise-free proxy of a step's host work). Steps that prefill are left out.

    inkling-compiled profile --model DIR --batch 1 --steps 64 [--speculative mtp] --out OUT
    python tools/host_ops.py OUT/trace.json
"""

import argparse
import collections
import json
import sys


def host_ops(trace: dict) -> tuple[int, collections.Counter]:
    """(decode steps seen, op name -> count over them)."""
    events = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X"), key=lambda e: (e["ts"], -e["dur"]))

    def inside(e: dict, outer: dict) -> bool:
        return outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]

    counts: collections.Counter = collections.Counter()
    steps = 0
    for step in (e for e in events if e["name"] == "step"):
        within = [e for e in events if e is not step and inside(e, step)]
        if any(e["name"].startswith("prefill") for e in within):
            continue
        steps += 1
        replays = [e for e in within if "replay bucket" in e["name"]]
        top: list[dict] = []
        for e in within:
            if e["name"].startswith(("aten::", "inkling::")) and not any(inside(e, r) for r in replays) \
                    and not any(inside(e, t) for t in top):
                top.append(e)
        counts.update(e["name"] for e in top)
    return steps, counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="trace.json written by `inkling-compiled profile`")
    args = ap.parse_args(argv)
    with open(args.trace) as f:
        steps, counts = host_ops(json.load(f))
    if not steps:
        print("no decode steps in the trace", file=sys.stderr)
        return 1
    print(f"{steps} decode steps, {sum(counts.values()) / steps:.1f} host torch ops a step")
    for name, n in counts.most_common():
        print(f"  {n / steps:5.1f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

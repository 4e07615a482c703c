"""The engine on another device against a reference recorded on CPU, where the suite holds the engine to
transformers: the shipped checkpoint's demo prompts, greedy, fp32.

    OMP_NUM_THREADS=1 python tools/device_parity.py --write tools/device_parity_ref.json   # on CPU
    python3 tools/device_parity.py --check tools/device_parity_ref.json --device cuda      # on the GPU

Each engine (eager, then compiled) is compared two ways. Teacher-forced: the reference's whole sequence
(prompt and completion) is scored as a prompt, so every position runs the prefill path on the same
tokens (eagerly in both engines: a step that scores prompt tokens is never the compiled extend graph),
and the largest |logprob difference| is reported. Free-running: greedy decode token by token;
the largest |difference| over the tokens both chose, and where the two part, the reference's own margin
between its token and the device's (a near-tie parts on rounding; a wide margin is a wrong result).
Exit status 1 when a teacher-forced difference passes --tolerance or a free run parts where the
reference's margin exceeds --margin.
"""

import argparse
import json
import sys

import torch

from inkling_compiled.cli import DEMO_PROMPTS
from inkling_compiled.engine import Engine
from inkling_compiled.sampling import SamplingParams
from inkling_compiled.tiny import trained_checkpoint

NEW_TOKENS = 48
TOP = 5  # top logprobs the reference keeps per step: the margin to a device's other choice


def record(engine: Engine, sequences: list[list[int]] | None = None) -> list[dict]:
    """Greedy outputs of the demo prompts, and the logprobs of `sequences` scored as prompts (by default
    each prompt with its own output: the reference's; a device scores the reference's, so that a run
    parting at a near-tie still scores the same tokens)."""
    free = engine.generate(DEMO_PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True,
                                                        top_logprobs=TOP))
    if sequences is None:
        sequences = [list(o.prompt_token_ids) + list(o.token_ids) for o in free]
    forced = engine.generate(sequences, SamplingParams(max_new_tokens=1, prompt_logprobs=0))
    return [dict(prompt=list(o.prompt_token_ids), tokens=list(o.token_ids), logprobs=list(o.logprobs),
                 top=[[list(pair) for pair in step] for step in o.top_logprobs], forced=f.prompt_logprobs[1:])
            for o, f in zip(free, forced)]


def compare(ref: list[dict], got: list[dict], margin: float) -> tuple[float, float, list[str]]:
    """(largest teacher-forced difference, largest free-running difference, problems)."""
    if [r["prompt"] for r in ref] != [g["prompt"] for g in got]:
        raise SystemExit("the reference's prompts are not this checkout's demo prompts: record it again (--write)")
    forced = max(abs(a - b) for r, g in zip(ref, got) for a, b in zip(r["forced"], g["forced"]))
    free, problems = 0.0, []
    for n, (r, g) in enumerate(zip(ref, got)):
        for i, (rt, gt) in enumerate(zip(r["tokens"], g["tokens"])):
            if rt != gt:
                top = dict(r["top"][i])
                gap = r["logprobs"][i] - top[gt] if gt in top else float("inf")
                verdict = "near-tie" if gap <= margin else "WRONG"
                line = f"prompt {n} parts at token {i}: reference {rt}, device {gt}, reference margin {gap:.2e}"
                print(f"    {line} ({verdict})")
                if gap > margin:
                    problems.append(line)
                break
            free = max(free, abs(r["logprobs"][i] - g["logprobs"][i]))
    return forced, free, problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", help="record the reference (CPU, eager, fp32) to this file")
    p.add_argument("--check", help="compare this device's engines against the reference in this file")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tolerance", type=float, default=1e-3, help="largest teacher-forced |logprob difference|")
    p.add_argument("--margin", type=float, default=1e-3, help="largest reference margin a free run may part at")
    a = p.parse_args()
    if bool(a.write) == bool(a.check):
        p.error("give exactly one of --write and --check")
    kw = dict(dtype=torch.float32, max_batch_size=8, progress=False)
    if a.write:
        with Engine.from_pretrained(trained_checkpoint(), device="cpu", compile=False, **kw) as engine:
            json.dump(record(engine), open(a.write, "w"))
        return 0
    ref = json.load(open(a.check))
    failed = False
    for compile in (False, True):
        with Engine.from_pretrained(trained_checkpoint(), device=a.device, compile=compile, **kw) as engine:
            print(f"{a.device} {'compiled' if compile else 'eager'}:")
            got = record(engine, [r["prompt"] + r["tokens"] for r in ref])
            forced, free, problems = compare(ref, got, a.margin)
        print(f"  teacher-forced: largest |logprob difference| {forced:.2e}; free-running, shared tokens: {free:.2e}")
        failed |= forced > a.tolerance or bool(problems)
    print("device parity:", "FAILED" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

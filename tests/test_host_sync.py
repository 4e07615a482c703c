"""The host-sync scan (tools/scan_host_sync.py): clean on the repo, catches each kind of sync, and its
scope really is what a decode step runs."""

import sys
from pathlib import Path

import torch

from inkling_compiled.engine import Engine
from inkling_compiled.metadata import GREEDY_PAD
from inkling_compiled.runner import forward_step

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import scan_host_sync  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_the_cuda_path_of_a_decode_step_never_syncs():
    assert scan_host_sync.scan_paths() == []


def test_each_kind_of_sync_is_caught_where_it_is_traced():
    source = (
        "def traced(x, lens):\n"
        "    a = x.sum().item()\n"
        "    b = lens.tolist()\n"
        "    c = x.cpu()\n"
        "    d = int(lens.max())\n"
        "    e = torch.nonzero(x)\n"
        "    f = x.unique()\n"
        "    g = torch.bincount(lens)\n"
        "    h = x.to('cpu')\n"
        "    torch.cuda.synchronize()\n"
        "    i = float(x[0])\n"
        "    j = torch.where(x > 0)\n"
        "    if x.any():\n"
        "        pass\n"
        "    return torch.where(x > 0, x, 0.0).float()\n"
        "def host_side(x):\n"
        "    return x.tolist()\n"
        "class InklingForCausalLM:\n"
        "    def forward_sequences(self, md):\n"
        "        return md.query_start_loc.tolist()\n"
        "def kernel(x):\n"
        "    return x.nonzero()\n"
        "op = define('op(Tensor x) -> Tensor', fake=None, reference=None, cuda=kernel)\n"
    )
    problems = scan_host_sync.scan_source(source, "m.py", {"traced", "InklingForCausalLM"})
    assert [p.split(":")[1] for p in problems] == ["2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13",
                                                   "22"]
    assert "`kernel` gives a shape that depends on data (nonzero)" in problems[-1]  # registered as CUDA kernel
    assert scan_host_sync.scan_source(source, "m.py", set())[0].startswith("m.py:22")  # out of scope: only cuda=


def test_the_scan_covers_every_function_a_decode_step_runs(checkpoint):
    """An eager decode step, profiled: every Python function of the package it calls (CPU kernels aside,
    which a CUDA step does not run) lies in the scan's scope; a new module on the step's path must be
    added to it."""
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=2, progress=False)
    engine.generate([[5, 6, 7]], engine_params())  # a live slot, so the step below reads real state
    engine.worker.backend.prepare_decode([9], [1], [3], [GREEDY_PAD])
    called = set()

    def profile(frame, event, arg):
        if event == "call":
            called.add((Path(frame.f_code.co_filename).resolve(), frame.f_code.co_qualname))

    sys.setprofile(profile)
    try:
        with torch.inference_mode():
            forward_step(engine.model, engine.worker.backend)
    finally:
        sys.setprofile(None)
    scopes = {(ROOT / rel).resolve(): scope for rel, scope in scan_host_sync.TRACED.items()}
    ours = [(f, q) for f, q in called if f.is_relative_to(ROOT / "inkling_compiled") or f.is_relative_to(ROOT / "graphs")
            or f.is_relative_to(ROOT / "custom_ops" / "gpu")]
    assert len(ours) > 20
    def scanned(f, qual):
        return any((f == p or f.is_relative_to(p)) and scan_host_sync.in_scope(qual, s) for p, s in scopes.items())

    # (comprehensions and lambdas are scanned with the function that holds them)
    outside = sorted(f"{f.relative_to(ROOT)}:{q}" for f, q in ours if "<" not in q and not scanned(f, q))
    assert outside == [], "\n".join(outside)


def engine_params():
    from inkling_compiled.sampling import SamplingParams

    return SamplingParams(max_new_tokens=1)

"""Starting a tensor-parallel engine: rank 0 spawns ranks 1.. on this machine (or joins the group
torchrun started, where the other ranks serve rank 0's plans inside this call and exit when it closes
the engine), loads its own shard and builds the engine around it."""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import torch

from ..config import InklingConfig
from ..errors import InklingError, OptionError
from ..loading import load_model, resolve_device
from ..quantize import resolve
from ..tokenizer import TextTokenizer
from ..worker import WORKER_OPTIONS
from . import runtime
from .group import check_divisible
from .ranks import ParallelError


def check_options(options: dict) -> None:
    """An OptionError for what tensor parallelism does not support."""
    if options.get("speculative") == "mtp":
        raise OptionError("speculative='mtp' is not supported with tensor parallelism (the MTP head is not "
                          "sharded): use speculative='ngram'")
    if options.get("host_cache_bytes"):
        raise OptionError("host_cache_bytes (the prefix cache's host tier) is not supported with tensor "
                          "parallelism: leave it 0")
    if options.get("cpp_wrapper"):
        raise OptionError("cpp_wrapper=True is not supported with tensor parallelism: inductor's C++ wrapper "
                          "cannot call the collectives (torch 2.13); leave it None")


def start(engine_class, path, world: int, timeout, device, dtype, check_finite: bool, options: dict,
          quantization: str | None = None):
    """Rank 0's engine of `world` ranks (`engine_class(model, tokenizer=..., ranks=..., **options)`)."""
    check_options(options)
    check_divisible(InklingConfig.from_file(Path(path)), world)  # before any process starts
    device = resolve_device(device)
    load_options = dict(dtype=dtype, check_finite=check_finite, quantization=resolve(quantization))
    # The other ranks only run the plans rank 0 sends: they build a Worker with its options, and verify
    # as many draft tokens as rank 0's drafter proposes.
    worker_options = {k: options[k] for k in (*WORKER_OPTIONS, "warmup") if k in options}
    if options.get("speculative") is not None:
        worker_options["draft_tokens"] = options.get("num_speculative_tokens", 2)
    if runtime.launched_by_torchrun():
        ranks = runtime.join(world, device, float(timeout))
        if ranks.rank != 0:
            local = torch.device(device.type, int(os.environ.get("LOCAL_RANK", ranks.rank))) \
                if device.type == "cuda" else device
            runtime.serve_rank(ranks, path, local, load_options, worker_options)
            raise SystemExit(0)
    else:
        ranks = runtime.spawn(world, device, float(timeout), (str(path), str(device), load_options, worker_options))
    try:
        model, _ = load_model(path, device=device, tensor_parallel=(0, world, ranks.compute_group), **load_options)
        engine = engine_class(model, tokenizer=TextTokenizer.from_checkpoint(path), device=device, ranks=ranks,
                              **options)
    except BaseException as e:
        dead = ranks.dead()
        ranks.close(graceful=False)
        if dead is not None and not isinstance(e, InklingError):  # an option error is rank 0's to report too
            raise ParallelError(f"{dead} while the engine was starting") from e
        raise
    weakref.finalize(engine, ranks.close)  # at exit or when dropped, the other ranks go too
    return engine

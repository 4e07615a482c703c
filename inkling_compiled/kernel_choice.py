"""Which kernel multiplies each weight shape on this machine, and in which layout: measured, not guessed.

For a matmul weight [O, H] (used as x @ W^T) the engine can store W or W^T contiguous, and multiply a
few rows by it with its own C++ kernel or with ATen's GEMM (MKL). Which is faster depends on the CPU,
its caches, the thread count and the rows, so the first time a shape is loaded on a machine both
kernels are timed in both layouts for each row count in ROWS (some 0.1 s per shape), the weight
streaming from memory the caches do not hold, as a decode step reads it. The layout whose best kernel
is faster over those rows is stored; the C++ kernel learns, per row count, whether it or ATen serves.

Results live in one file per machine key (CPU model, instruction set, core count, torch, the kernels'
build, the thread count) under the cache directory, as inductor keeps its autotuning: a different
machine, build or thread count measures afresh. A file that does not parse, or whose key is another
machine's, is ignored with a warning and rewritten. INKLING_FEW_ROWS=N skips all of this (the C++
kernel up to N rows, layouts by shape): an override, for comparisons.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path

import msgspec
import torch

log = logging.getLogger("inkling_compiled")

ROWS = (1, 2, 4, 8, 16, 32)  # row counts measured; a count in between takes the next one up, more go to ATen
MAX_ROWS = 64  # the C++ kernel's limit
STREAM_BYTES = 512 << 20  # the buffer measurements walk through: past the last-level cache
CALLS = 16  # per pass of a measurement, at most ...
CALL_BYTES = 32 << 20  # ... and about this much weight read per pass
PASSES = 3
FORMAT = 1


class ShapeChoice(msgspec.Struct):
    """One weight shape's measurement: microseconds per call, per layout and row count."""
    out_features: int
    in_features: int
    column_major: bool  # the layout chosen: W^T contiguous
    ours_us: dict[str, list[float]]  # "W" | "W^T" -> one time per row count of ROWS
    aten_us: dict[str, list[float]]

    @property
    def layout(self) -> str:
        return "W^T" if self.column_major else "W"

    def ours_rows(self, layout: str | None = None) -> list[int]:
        """The measured row counts at which the C++ kernel beats ATen (in the chosen layout by default)."""
        layout = layout or self.layout
        return [r for r, ours, aten in zip(ROWS, self.ours_us[layout], self.aten_us[layout]) if ours <= aten]

    def rows_mask(self, layout: str) -> int:
        """Bit r-1 set = the C++ kernel for r rows (1 <= r <= MAX_ROWS); a count between two measured
        ones takes the choice of the next one up."""
        return _mask_of(set(self.ours_rows(layout)))


def _mask_of(won: set[int]) -> int:
    """Bit r-1 set for every r whose next measured count up (in ROWS) is in `won`."""
    mask = 0
    for r in range(1, ROWS[-1] + 1):
        if next(m for m in ROWS if m >= r) in won:
            mask |= 1 << (r - 1)
    return mask


def experts_mask(gate_up: ShapeChoice, down: ShapeChoice) -> int:
    """An expert bank's rows mask: the C++ kernel at the row counts where its two projections (each in its
    chosen layout) take less time together than ATen's. Either way the op runs the two matmuls and the
    kernel's silu * up between them, and nothing else, so the sum of the two is what an expert costs."""
    won = {r for r, og, ag, od, ad in zip(ROWS, gate_up.ours_us[gate_up.layout], gate_up.aten_us[gate_up.layout],
                                          down.ours_us[down.layout], down.aten_us[down.layout]) if og + od <= ag + ad}
    return _mask_of(won)


class ChoiceFile(msgspec.Struct):
    format: int
    key: dict[str, str]
    shapes: list[ShapeChoice]


def machine_key(threads: int) -> dict[str, str]:
    """What a measurement depends on: the CPU, the kernels' build, torch, the thread count."""
    from .custom_ops.library import cpu_isa, extension_dir

    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu": model, "machine": platform.machine(), "cores": str(os.cpu_count()), "isa": str(cpu_isa()),
            "kernels": extension_dir().name, "torch": str(torch.__version__), "threads": str(threads)}


def choices_path(key: dict[str, str]) -> Path:
    from .paths import default_cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return default_cache_dir() / "kernel-choices" / f"{digest}.json"


@functools.cache
def _native_fn(name: str, argtypes: tuple):
    from .custom_ops.library import native_library

    native = native_library()
    if native is None:
        raise RuntimeError("the inkling C++ CPU kernels are not loaded: there is no kernel to choose")
    fn = getattr(native, name)
    fn.argtypes = list(argtypes)
    return fn


def _set_choice(o: int, h: int, column_major: bool, threads: int, mask: int) -> None:
    _native_fn("inkling_set_matmul_choice", (ctypes.c_int64,) * 4 + (ctypes.c_uint64,))(
        o, h, int(column_major), threads, mask)


def _per_call_us(fn, weights: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for w in weights:
        fn(w)
    return (time.perf_counter() - t0) / len(weights) * 1e6


class WeightStream:
    """Weights for timing, as views that walk through one buffer larger than the last-level cache: each
    call reads memory no call touched for the last STREAM_BYTES, as a decode step reads each weight once
    among hundreds of megabytes of others. One buffer serves every shape a load measures."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.offset = 0

    def views(self, o: int, h: int, column_major: bool, count: int) -> list[torch.Tensor]:
        size = (o * h + 15) // 16 * 16  # each view starts on a 64-byte line
        if self.buffer is None or self.buffer.numel() < 2 * size:
            self.buffer = torch.full((max(STREAM_BYTES // 4, 2 * size),), 0.5)
            self.offset = 0
        out = []
        for _ in range(count):
            if self.offset + size > self.buffer.numel():
                self.offset = 0
            flat = self.buffer[self.offset:self.offset + o * h]
            out.append(flat.view(h, o).t() if column_major else flat.view(o, h))  # [O, H] either way
            self.offset += size
        return out

    def release(self) -> None:
        self.buffer = None


def measure_shape(o: int, h: int, threads: int, stream: WeightStream | None = None) -> ShapeChoice:
    """Times the C++ kernel and ATen at every row count of ROWS, in both layouts, at `threads`."""
    stream = stream or WeightStream()
    calls = max(4, min(CALLS, CALL_BYTES // max(1, o * h * 4)))
    ours: dict[str, list[float]] = {}
    aten: dict[str, list[float]] = {}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for layout in ("W", "W^T"):
            ours[layout], aten[layout] = [], []
            for rows in ROWS:
                x = torch.full((rows, h), 0.25)
                best = {"ours": float("inf"), "aten": float("inf")}
                # Both through the op, as the engine calls them: only the kernel behind it differs. Passes
                # alternate, and each kernel keeps its best: a pass a neighbour disturbed loses.
                for _ in range(PASSES):
                    for kernel, mask in (("ours", (1 << MAX_ROWS) - 1), ("aten", 0)):
                        _set_choice(o, h, layout == "W^T", threads, mask)
                        weights = stream.views(o, h, layout == "W^T", calls + 1)
                        torch.ops.inkling.linear(x, weights.pop())  # warm: code paths, scratch buffers
                        best[kernel] = min(best[kernel], _per_call_us(lambda w: torch.ops.inkling.linear(x, w),
                                                                      weights))
                ours[layout].append(best["ours"])
                aten[layout].append(best["aten"])
    finally:
        torch.set_num_threads(before)
    # The layout whose faster kernel does better over the row counts, each weighed by its best time.
    score = {layout: sum(min(a, b) / min(min(ours[m][i], aten[m][i]) for m in ours)
                         for i, (a, b) in enumerate(zip(ours[layout], aten[layout]))) for layout in ours}
    return ShapeChoice(o, h, score["W^T"] < score["W"], ours, aten)


def _well_formed(s: ShapeChoice) -> bool:
    return (set(s.ours_us) == set(s.aten_us) == {"W", "W^T"}
            and all(len(t) == len(ROWS) for d in (s.ours_us, s.aten_us) for t in d.values()))


class KernelChoices:
    """The measured choices of this machine at one thread count, loaded from and saved to its file."""

    def __init__(self, threads: int):
        self.threads = threads
        self.key = machine_key(threads)
        self.path = choices_path(self.key)
        self.shapes: dict[tuple[int, int], ShapeChoice] = {}
        self.measured: list[tuple[int, int]] = []  # shapes this process measured (not from the file)
        self.stream = WeightStream()  # held while a load measures; release_stream() frees it
        self._lock = threading.Lock()
        self._read()

    def _read(self) -> None:
        if not self.path.is_file():
            return
        try:
            saved = msgspec.json.decode(self.path.read_bytes(), type=ChoiceFile)
        except (msgspec.DecodeError, msgspec.ValidationError, OSError) as e:
            log.warning("ignoring the kernel choice cache %s (it does not parse: %s); measuring again", self.path, e)
            return
        if saved.format != FORMAT or saved.key != self.key:
            log.warning("ignoring the kernel choice cache %s: it was measured for another machine, build or thread "
                        "count (%s); measuring again", self.path, saved.key)
            return
        good = [s for s in saved.shapes if _well_formed(s)]
        if len(good) != len(saved.shapes):
            log.warning("ignoring %d malformed entries of the kernel choice cache %s", len(saved.shapes) - len(good),
                        self.path)
        self.shapes = {(s.out_features, s.in_features): s for s in good}

    def _write(self) -> None:
        """Saves every shape, those another process of this key saved meanwhile included (the last writer
        wins a race; a shape it drops is measured again later). A cache that cannot be written is a
        warning: the choices still serve this process."""
        try:
            saved = msgspec.json.decode(self.path.read_bytes(), type=ChoiceFile)
            if saved.format == FORMAT and saved.key == self.key:
                for s in filter(_well_formed, saved.shapes):
                    self.shapes.setdefault((s.out_features, s.in_features), s)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            pass
        data = ChoiceFile(FORMAT, self.key, sorted(self.shapes.values(), key=lambda s: (s.out_features, s.in_features)))
        scratch = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch.write_bytes(msgspec.json.format(msgspec.json.encode(data)))
            os.replace(scratch, self.path)  # another process reading at the same moment sees a whole file
        except OSError as e:
            log.warning("could not save the kernel choices to %s (%s); they hold for this process only", self.path, e)

    def choice(self, o: int, h: int) -> ShapeChoice:
        """The shape's choice, measured now (and saved) if this machine has none yet; the C++ kernels
        learn it at once."""
        with self._lock:
            found = self.shapes.get((o, h))
            if found is None:
                if not self.measured:
                    sys.stderr.write("inkling-compiled: timing the matmul kernels for this machine's weight shapes "
                                     f"(once per machine and thread count; saved in {self.path})\n")
                found = self.shapes[(o, h)] = measure_shape(o, h, self.threads, self.stream)
                self.measured.append((o, h))
                self._write()
            for layout in ("W", "W^T"):
                _set_choice(o, h, layout == "W^T", self.threads, found.rows_mask(layout))
            return found

    def experts(self, intermediate: int, hidden: int) -> int:
        """Sets (and returns) the choice of the routed-expert banks gate_up [2I, H] and down [H, I], from their
        two shapes' measurements (`experts_mask`): an expert's rows go through one kernel for both."""
        gate_up, down = self.choice(2 * intermediate, hidden), self.choice(hidden, intermediate)
        mask = experts_mask(gate_up, down)
        fn = _native_fn("inkling_set_experts_choice", (ctypes.c_int64,) * 5 + (ctypes.c_uint64,))
        fn(intermediate, hidden, int(gate_up.column_major), int(down.column_major), self.threads, mask)
        return mask

    def release_stream(self) -> None:
        """Frees the timing buffer (a load calls this once every weight is in place)."""
        with self._lock:
            self.stream.release()


_choices: dict[int, KernelChoices] = {}
_choices_lock = threading.Lock()


def forget_installed() -> None:
    """Clears the C++ kernels' table (every shape back to the default) and this process's choices."""
    from .custom_ops.library import native_library

    if (native := native_library()) is not None:
        native.inkling_clear_matmul_choices()
    with _choices_lock:
        _choices.clear()


def for_this_machine(threads: int | None = None) -> KernelChoices | None:
    """This process's choices at `threads` (default: torch's current count); None where nothing is to
    choose: no C++ kernels, or INKLING_FEW_ROWS set."""
    from .custom_ops.library import native_kernels

    if os.environ.get("INKLING_FEW_ROWS") is not None or not native_kernels():
        return None
    threads = threads or torch.get_num_threads()
    with _choices_lock:
        if threads not in _choices:
            _choices[threads] = KernelChoices(threads)
        return _choices[threads]

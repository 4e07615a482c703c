"""Kernel choice by measurement: one cache file per machine key, measured once, rebuilt when the key
changes, ignored (with a warning) when corrupted or another machine's; the choice reaches both the
loader's layout and the C++ op's kernel."""

import logging

import msgspec
import pytest
import torch

from inkling_compiled import kernel_choice
from inkling_compiled.kernel_choice import ROWS, ChoiceFile, KernelChoices, ShapeChoice
from inkling_compiled.loading import load_model


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    real_path = kernel_choice.choices_path  # the files in a folder of the test's (the C++ build stays shared)
    monkeypatch.setattr(kernel_choice, "choices_path", lambda key: tmp_path / real_path(key).name)
    monkeypatch.delenv("INKLING_FEW_ROWS", raising=False)
    kernel_choice.forget_installed()
    yield tmp_path
    kernel_choice.forget_installed()  # forged choices must not outlive the test


def _count_measurements(monkeypatch) -> list:
    measured = []
    real = kernel_choice.measure_shape

    def counting(o, h, threads, stream=None):
        measured.append((o, h, threads))
        return real(o, h, threads, stream)

    monkeypatch.setattr(kernel_choice, "measure_shape", counting)
    return measured


def _forged(o: int, h: int, *, column_major: bool, ours_wins: bool) -> ShapeChoice:
    fast, slow = [1.0] * len(ROWS), [2.0] * len(ROWS)
    ours, aten = (fast, slow) if ours_wins else (slow, fast)
    return ShapeChoice(o, h, column_major, {"W": ours, "W^T": ours}, {"W": aten, "W^T": aten})


def _write(choices: KernelChoices, shapes, key=None) -> None:
    choices.path.parent.mkdir(parents=True, exist_ok=True)
    choices.path.write_bytes(msgspec.json.encode(ChoiceFile(kernel_choice.FORMAT, key or choices.key, shapes)))


def test_a_shape_is_measured_once_per_machine_and_read_back_after(monkeypatch):
    measured = _count_measurements(monkeypatch)
    first = KernelChoices(threads=1)
    choice = first.choice(40, 24)
    assert measured == [(40, 24, 1)] and first.path.is_file()
    assert len(choice.ours_us["W"]) == len(ROWS) and all(t > 0 for t in choice.aten_us["W^T"])
    first.choice(40, 24)
    again = KernelChoices(threads=1)  # a new process on the same machine: read, not measured
    assert again.choice(40, 24) == choice and measured == [(40, 24, 1)]


def test_a_new_machine_key_measures_afresh(monkeypatch):
    measured = _count_measurements(monkeypatch)
    KernelChoices(threads=1).choice(40, 24)
    other = KernelChoices(threads=2)  # another thread count is another key
    assert other.path != KernelChoices(threads=1).path
    other.choice(40, 24)
    real_key = kernel_choice.machine_key
    monkeypatch.setattr(kernel_choice, "machine_key", lambda threads: {**real_key(threads), "cpu": "another CPU"})
    KernelChoices(threads=1).choice(40, 24)
    assert measured == [(40, 24, 1), (40, 24, 2), (40, 24, 1)]


@pytest.mark.parametrize("damage", ["garbage", "foreign", "malformed"])
def test_a_corrupted_or_foreign_cache_is_ignored_with_a_warning(damage, monkeypatch, caplog):
    measured = _count_measurements(monkeypatch)
    choices = KernelChoices(threads=1)
    if damage == "garbage":
        choices.path.parent.mkdir(parents=True, exist_ok=True)
        choices.path.write_bytes(b'{"format": 1, "key": {"cpu": ')
    elif damage == "foreign":
        _write(choices, [_forged(40, 24, column_major=True, ours_wins=True)], key={**choices.key, "cpu": "elsewhere"})
    else:  # times for too few row counts
        bad = _forged(40, 24, column_major=True, ours_wins=True)
        bad.ours_us["W"] = [1.0]
        _write(choices, [bad])
    with caplog.at_level(logging.WARNING, logger="inkling_compiled"):
        reread = KernelChoices(threads=1)
    assert any("kernel choice cache" in r.getMessage() for r in caplog.records)
    reread.choice(40, 24)
    assert measured == [(40, 24, 1)]  # measured, not taken from the bad file
    saved = msgspec.json.decode(reread.path.read_bytes(), type=ChoiceFile)  # and the file rewritten whole
    assert saved.key == reread.key and [(s.out_features, s.in_features) for s in saved.shapes] == [(40, 24)]


def _aten_ran(x, w) -> bool:
    with torch.profiler.profile() as prof:
        torch.ops.inkling.linear(x, w)
    return any(e.name in ("aten::mm", "aten::addmm", "aten::matmul") for e in prof.events())


def test_the_op_runs_the_kernel_the_choice_names():
    choices = KernelChoices(threads=torch.get_num_threads())
    w, x = torch.randn(72, 24), torch.randn(3, 24)
    for ours_wins in (True, False):
        _write(choices, [_forged(72, 24, column_major=False, ours_wins=ours_wins)])
        KernelChoices(threads=torch.get_num_threads()).choice(72, 24)
        assert _aten_ran(x, w) == (not ours_wins)
        assert torch.allclose(torch.ops.inkling.linear(x, w), torch.nn.functional.linear(x, w), atol=1e-5)


def experts_by_loop(x, idx, w, gate_up, down) -> torch.Tensor:
    """The routed experts as a plain loop over each token's choices."""
    I = down.shape[2]
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            gu = gate_up[idx[t, k]] @ x[t]
            want[t] += w[t, k] * (down[idx[t, k]] @ (torch.nn.functional.silu(gu[:I]) * gu[I:]))
    return want


@pytest.mark.parametrize("down_ours_us, ours_serves", [(2.5, True), (4.0, False)])
def test_an_expert_bank_takes_the_kernel_its_two_projections_are_faster_on_together(down_ours_us, ours_serves):
    """gate_up alone wins on ours (1 us against 2), down alone loses (2.5 or 4 against 2): the bank takes
    the kernel whose two projections take less time together (3.5 < 4: ours; 5 > 4: ATen), for both."""
    I, H = 12, 24
    gate_up = ShapeChoice(2 * I, H, False, {"W": [1.0] * 6, "W^T": [9.0] * 6}, {"W": [2.0] * 6, "W^T": [9.0] * 6})
    down = ShapeChoice(H, I, False, {"W": [down_ours_us] * 6, "W^T": [9.0] * 6}, {"W": [2.0] * 6, "W^T": [9.0] * 6})
    choices = KernelChoices(threads=torch.get_num_threads())
    _write(choices, [gate_up, down])
    mask = KernelChoices(threads=torch.get_num_threads()).experts(I, H)
    assert mask == ((1 << 32) - 1 if ours_serves else 0)
    x, E = torch.randn(2, H), 3
    idx, w = torch.tensor([[0, 1], [0, 2]]), torch.full((2, 2), 0.5)
    banks = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    with torch.profiler.profile() as prof:
        got = torch.ops.inkling.moe_experts(x, idx, w, *banks)
    assert any(e.name in ("aten::mm", "aten::addmm", "aten::matmul") for e in prof.events()) == (not ours_serves)
    assert torch.allclose(got, experts_by_loop(x, idx, w, *banks), atol=1e-4)


@pytest.mark.parametrize("column_major", [False, True])
def test_an_expert_on_atens_gemm_runs_two_gemms_and_nothing_else_of_atens(column_major):
    """Where ATen serves an expert, its rows go through two GEMMs into the op's scratch and the kernel's
    silu * up between them: views, silu and products as ATen calls once cost a batch-1 step of `small`
    about 0.4 ms (14 experts a step). Both layouts of the banks; the result against a plain loop."""
    I, H = 12, 24
    slow = {"W": [9.0] * 6, "W^T": [9.0] * 6}
    fast = {"W": [1.0] * 6, "W^T": [1.0] * 6}
    _write(KernelChoices(threads=torch.get_num_threads()),
           [ShapeChoice(2 * I, H, column_major, slow, fast), ShapeChoice(H, I, column_major, slow, fast)])
    assert KernelChoices(threads=torch.get_num_threads()).experts(I, H) == 0  # ATen at every row count
    g = torch.Generator().manual_seed(8)
    x, idx, w = torch.randn(3, H, generator=g), torch.tensor([[0, 1], [0, 2], [1, 0]]), torch.rand(3, 2, generator=g)
    banks = torch.randn(3, 2 * I, H, generator=g), torch.randn(3, H, I, generator=g)
    if column_major:
        banks = tuple(b.transpose(1, 2).contiguous().transpose(1, 2) for b in banks)
    with torch.profiler.profile() as prof:
        got = torch.ops.inkling.moe_experts(x, idx, w, *banks)
    names = [e.name for e in prof.events()]
    assert names.count("aten::mm") == 2 * 3, names  # two an expert
    assert not {"aten::linear", "aten::silu", "aten::mul", "aten::narrow", "aten::select"} & set(names), names
    assert torch.allclose(got, experts_by_loop(x, idx, w, *banks), atol=1e-4)


def test_rows_between_measured_counts_take_the_next_one_up():
    choice = ShapeChoice(8, 8, False, {"W": [1, 1, 9, 1, 9, 9], "W^T": [9] * 6}, {"W": [5] * 6, "W^T": [5] * 6})
    assert choice.ours_rows() == [1, 2, 8]
    mask = choice.rows_mask("W")
    assert [r for r in range(1, 65) if mask >> (r - 1) & 1] == [1, 2, 5, 6, 7, 8]
    assert choice.rows_mask("W^T") == 0


def test_the_loader_stores_each_weight_in_the_layout_measured_for_its_shape(checkpoint):
    path = checkpoint("tiny")
    choices = kernel_choice.for_this_machine()
    # Flip every measured layout of the tiny model: the loader must follow the file, not the shape rule.
    load_model(path)
    flipped = [ShapeChoice(s.out_features, s.in_features, not s.column_major, s.ours_us, s.aten_us)
               for s in choices.shapes.values()]
    _write(choices, flipped)
    kernel_choice.forget_installed()
    model, _ = load_model(path)
    layouts = {(s.out_features, s.in_features): s.column_major for s in flipped}
    checked = 0
    for name, p in model.named_parameters():
        key = tuple(p.shape[-2:])
        if kernel_choice_shape(name, p) and key in layouts:
            assert (p.stride(-2) == 1) == layouts[key], name
            checked += 1
    assert checked >= 8


def kernel_choice_shape(name, p) -> bool:
    from inkling_compiled.loading import is_matmul_weight

    return is_matmul_weight(name, tuple(p.shape))


def test_a_cache_that_cannot_be_written_is_a_warning_and_the_choice_still_serves(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setattr(kernel_choice, "choices_path", lambda key: blocker / "choices.json")
    with caplog.at_level(logging.WARNING, logger="inkling_compiled"):
        choice = KernelChoices(threads=1).choice(40, 24)
    assert len(choice.ours_us["W"]) == len(ROWS)
    assert any("could not save the kernel choices" in r.getMessage() for r in caplog.records)


def test_a_load_times_every_shape_before_it_frees_the_timing_buffer(checkpoint, monkeypatch):
    """The stacked projections' shapes are timed while the load holds its timing buffer (hundreds of MB),
    and nothing holds that buffer once the load returns."""
    released = []
    measured = _count_measurements(monkeypatch)
    real = kernel_choice.WeightStream.release

    def release(stream):
        released.append(len(measured))
        real(stream)

    monkeypatch.setattr(kernel_choice.WeightStream, "release", release)
    model, _ = load_model(checkpoint("tiny"))
    stacked = tuple(model.model.layers[0].self_attn.qkvr_proj.weight.shape)
    assert stacked in [(o, h) for o, h, _ in measured]
    assert released and released[-1] == len(measured)
    assert kernel_choice.for_this_machine().stream.buffer is None

"""Short-conv kernels over one (layer, stream) slice of the conv-state pool.

`state` is `[slots, K-1, D]` fp32 with any strides; one program owns one (row, channel block), so a
slot's window is read whole before any of it is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 128


def _check_channels(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> None:
    """The kernels step channels by 1 (rows and slots by their strides) and a weight's taps by 1."""
    assert x.stride(-1) == 1 and state.stride(-1) == 1 and weight.stride(1) == 1, "channels must be contiguous"


@triton.jit
def _decode_kernel(x_ptr, state_ptr, w_ptr, idx_ptr, y_ptr, D, sx, ss_slot, ss_tap, sw, sy,
                   K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dm = d < D
    slot = tl.load(idx_ptr + row).to(tl.int64)
    x = tl.load(x_ptr + row * sx + d, mask=dm, other=0.0).to(tl.float32)
    j = tl.arange(0, KP)[:, None]  # window taps, oldest first
    tap = (j < K - 1) & dm[None, :]
    window = tl.load(state_ptr + slot * ss_slot + j * ss_tap + d[None, :], mask=tap, other=0.0)
    w_hist = tl.load(w_ptr + d[None, :] * sw + j, mask=tap, other=0.0)
    w_now = tl.load(w_ptr + d * sw + (K - 1), mask=dm, other=0.0)
    y = x * w_now + tl.sum(window * w_hist, axis=0)
    # Shift in x: tap j takes tap j+1 (read again from memory: the loads above precede every store).
    later = tl.load(state_ptr + slot * ss_slot + (j + 1) * ss_tap + d[None, :], mask=(j < K - 2) & dm[None, :],
                    other=0.0)
    shifted = tl.where(j == K - 2, x[None, :], later)
    tl.debug_barrier()  # every thread's reads of the window land before any thread's writes
    tl.store(state_ptr + slot * ss_slot + j * ss_tap + d[None, :], shifted, mask=tap)
    tl.store(y_ptr + row * sy + d, y.to(y_ptr.dtype.element_ty), mask=dm)


def sconv_decode(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, cache_indices: torch.Tensor,
                 layer_id: int = -1, stream: int = -1) -> torch.Tensor:
    B, D = x.shape
    K = weight.shape[1]
    y = torch.empty_like(x)
    if B == 0:
        return y
    _check_channels(x, state, weight)
    _decode_kernel[(B, triton.cdiv(D, BLOCK_D))](
        x, state, weight, cache_indices, y, D, x.stride(0), state.stride(0), state.stride(1), weight.stride(0),
        y.stride(0), K=K, KP=triton.next_power_of_2(K), BLOCK=BLOCK_D)
    return y


@triton.jit
def _extend_kernel(x_ptr, state_ptr, w_ptr, qsl_ptr, init_ptr, idx_ptr, y_ptr, B, D, sx, ss_slot, ss_tap, sw, sy,
                   K: tl.constexpr, BP: tl.constexpr, BLOCK: tl.constexpr):
    """One token per program: its taps come from its own sequence or, before the sequence's start, from
    the slot's window (zero without initial state)."""
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dm = d < D
    rows = tl.arange(0, BP)
    ends = tl.load(qsl_ptr + 1 + rows, mask=rows < B, other=2147483647)
    row = tl.sum((ends <= t).to(tl.int32), axis=0)  # the sequence this token belongs to
    start = tl.load(qsl_ptr + row)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    has_history = tl.load(init_ptr + row) != 0
    y = tl.load(x_ptr + t * sx + d, mask=dm, other=0.0).to(tl.float32) * tl.load(w_ptr + d * sw + (K - 1), mask=dm)
    for back in tl.static_range(1, K):
        src = t - back
        inside = src >= start
        hist_pos = (K - 1) - (start - src)
        from_x = tl.load(x_ptr + src * sx + d, mask=dm & inside, other=0.0)
        from_state = tl.load(state_ptr + slot * ss_slot + hist_pos * ss_tap + d,
                             mask=dm & (src < start) & has_history & (hist_pos >= 0), other=0.0)
        y += tl.where(inside, from_x, from_state) * tl.load(w_ptr + d * sw + (K - 1 - back), mask=dm)
    tl.store(y_ptr + t * sy + d, y.to(y_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _extend_window_kernel(x_ptr, state_ptr, qsl_ptr, init_ptr, idx_ptr, D, sx, ss_slot, ss_tap,
                          K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    """Each slot's new window: the K-1 inputs ending at its sequence's end, reaching into the old window
    for sequences shorter than K-1 (run after `_extend_kernel`, which reads the old windows)."""
    row = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dm = d[None, :] < D
    start = tl.load(qsl_ptr + row)
    end = tl.load(qsl_ptr + row + 1)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    has_history = tl.load(init_ptr + row) != 0
    j = tl.arange(0, KP)[:, None]
    tap = (j < K - 1) & dm
    src = end - (K - 1) + j
    inside = src >= start
    from_x = tl.load(x_ptr + src * sx + d[None, :], mask=tap & inside, other=0.0)
    hist_pos = (K - 1) - (start - src)
    from_state = tl.load(state_ptr + slot * ss_slot + hist_pos * ss_tap + d[None, :],
                         mask=tap & (src < start) & has_history, other=0.0)
    tl.debug_barrier()  # as in _decode_kernel: reads of the old window first
    tl.store(state_ptr + slot * ss_slot + j * ss_tap + d[None, :], tl.where(inside, from_x, from_state), mask=tap)


def sconv_extend(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, query_start_loc: torch.Tensor,
                 has_initial_state: torch.Tensor, cache_indices: torch.Tensor, layer_id: int = -1,
                 stream: int = -1) -> torch.Tensor:
    (T, D), K, B = x.shape, weight.shape[1], cache_indices.shape[0]
    y = torch.empty_like(x)
    if B == 0:
        return y
    _check_channels(x, state, weight)
    blocks = triton.cdiv(D, BLOCK_D)
    if T:
        _extend_kernel[(T, blocks)](x, state, weight, query_start_loc, has_initial_state, cache_indices, y, B, D,
                                    x.stride(0), state.stride(0), state.stride(1), weight.stride(0), y.stride(0),
                                    K=K, BP=triton.next_power_of_2(B), BLOCK=BLOCK_D)
    _extend_window_kernel[(B, blocks)](x, state, query_start_loc, has_initial_state, cache_indices, D, x.stride(0),
                                       state.stride(0), state.stride(1), K=K, KP=triton.next_power_of_2(K),
                                       BLOCK=BLOCK_D)
    return y


@triton.jit
def _verify_kernel(x_ptr, state_ptr, w_ptr, idx_ptr, win_ptr, y_ptr, D, sx, ss_slot, ss_tap, sw, sy, sv_row, sv_step,
                   sv_tap, T_D: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row, token, channel block). Token t of row b sees the row's tokens before it and,
    further back, the slot's window, which is only read; it saves the window after itself: entries
    t+1..t+K-1 of [window ++ the row's tokens]."""
    b, t = tl.program_id(0).to(tl.int64), tl.program_id(1)
    d = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    dm = d < D
    slot = tl.load(idx_ptr + b).to(tl.int64)
    row0 = b * T_D
    y = tl.load(x_ptr + (row0 + t) * sx + d, mask=dm, other=0.0).to(tl.float32) * tl.load(w_ptr + d * sw + (K - 1),
                                                                                          mask=dm)
    for back in tl.static_range(1, K):
        src = t - back
        inside = src >= 0
        from_x = tl.load(x_ptr + (row0 + src) * sx + d, mask=dm & inside, other=0.0)
        from_state = tl.load(state_ptr + slot * ss_slot + (K - 1 + src) * ss_tap + d, mask=dm & (src < 0), other=0.0)
        y += tl.where(inside, from_x, from_state) * tl.load(w_ptr + d * sw + (K - 1 - back), mask=dm)
    tl.store(y_ptr + (row0 + t) * sy + d, y.to(y_ptr.dtype.element_ty), mask=dm)
    for w in tl.static_range(0, K - 1):
        i = t + 1 + w  # index in [window ++ tokens]
        from_state = tl.load(state_ptr + slot * ss_slot + i * ss_tap + d, mask=dm & (i < K - 1), other=0.0)
        from_x = tl.load(x_ptr + (row0 + i - (K - 1)) * sx + d, mask=dm & (i >= K - 1), other=0.0)
        tl.store(win_ptr + b * sv_row + t * sv_step + w * sv_tap + d, tl.where(i < K - 1, from_state, from_x), mask=dm)


def sconv_verify(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, cache_indices: torch.Tensor,
                 windows: torch.Tensor, layer_id: int = -1, stream: int = -1) -> torch.Tensor:
    """Signature and result of `sconv.sconv_verify_reference`."""
    B, T_d, K, D = cache_indices.shape[0], windows.shape[1], weight.shape[1], x.shape[1]
    y = torch.empty_like(x)
    if B == 0:
        return y
    _check_channels(x, state, weight)
    assert windows.stride(-1) == 1, "channels must be contiguous"
    _verify_kernel[(B, T_d, triton.cdiv(D, BLOCK_D))](
        x, state, weight, cache_indices, windows, y, D, x.stride(0), state.stride(0), state.stride(1),
        weight.stride(0), y.stride(0), windows.stride(0), windows.stride(1), windows.stride(2), T_D=T_d, K=K,
        BLOCK=BLOCK_D)
    return y


@triton.jit
def _commit_kernel(state_ptr, win_ptr, slot_ptr, step_ptr, n, ss_slot, sv_row, sv_step, BLOCK: tl.constexpr):
    """One program per (verify row, block of the window's (K-1)*D contiguous values)."""
    i = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    step = tl.load(step_ptr + i).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    m = (e < n) & (step >= 0)
    saved = tl.load(win_ptr + i * sv_row + step * sv_step + e, mask=m, other=0.0)
    tl.store(state_ptr + slot * ss_slot + e, saved, mask=m)


def commit_conv_windows(states: list[torch.Tensor], windows: list[torch.Tensor], slots: torch.Tensor,
                        steps: torch.Tensor) -> None:
    """Signature and effect of `sconv.commit_conv_windows_reference`: one launch per (stream, layer) tensor."""
    rows = slots.shape[0]
    if rows == 0:
        return
    for state, saved in zip(states, windows):
        _, taps, D = state.shape
        assert state.stride(-1) == 1 and state.stride(-2) == D and saved.stride(-1) == 1 and saved.stride(-2) == D, \
            "each window must be one contiguous run of (K-1)*D values"
        n = taps * D
        _commit_kernel[(rows, triton.cdiv(n, BLOCK_D))](
            state, saved, slots, steps, n, state.stride(0), saved.stride(0), saved.stride(1), BLOCK=BLOCK_D)

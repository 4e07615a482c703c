"""Short-conv ops over one (layer, stream) slice of the conv-state pool.

`state` is `[slots, K-1, D]` fp32, a view `pool.conv[stream][layer]` handed in by the step backend;
each op declares that it mutates exactly that slice. Slot ids come in as int32; padded rows point at
slot 0, the pool's dummy, which is written but never read for a live request.
"""

from __future__ import annotations

import torch

from .library import define, gpu_kernel
from .reference import packed_causal_conv


def sconv_decode_reference(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, cache_indices: torch.Tensor,
                           layer_id: int = -1, stream: int = -1) -> torch.Tensor:
    """One token per row: y = conv over [window, x] (no residual); the window shifts in x, in place.

    x [B, D] fp32, weight [D, K] fp32, cache_indices [B] int32 -> y [B, D]. layer_id and stream only
    name the call in profiles (the C++ kernel records a `sconv S @ layer L` range).
    """
    K = weight.shape[1]
    idx = cache_indices.long()
    window = state.index_select(0, idx)  # [B, K-1, D]
    y = x * weight[:, K - 1]
    for back in range(1, K):
        y = y + window[:, K - 1 - back] * weight[:, K - 1 - back]
    state.index_copy_(0, idx, torch.cat([window[:, 1:], x[:, None]], dim=1))
    return y


def sconv_extend_reference(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, query_start_loc: torch.Tensor,
                           has_initial_state: torch.Tensor, cache_indices: torch.Tensor, layer_id: int = -1,
                           stream: int = -1) -> torch.Tensor:
    """Packed variable-length tokens: y = conv (no residual) with each sequence's history.

    x [T, D] fp32 packed by query_start_loc [B+1] int32; history is the slot's window where
    has_initial_state [B] is true and zeros elsewhere. Afterwards each slot holds the last K-1 inputs
    of [history ++ its tokens] (the history itself shifts through for sequences shorter than K-1).
    """
    K, B = weight.shape[1], cache_indices.shape[0]
    qsl = query_start_loc.long()
    lens = qsl[1:] - qsl[:-1]
    idx = cache_indices.long()
    row_of_token = torch.repeat_interleave(torch.arange(B, device=x.device), lens, output_size=x.shape[0])
    history = torch.where(has_initial_state[:, None, None], state.index_select(0, idx), 0.0)  # [B, K-1, D]
    y = packed_causal_conv(x, weight, qsl[:-1][row_of_token], history, row_of_token)

    # Final window: the K-1 inputs ending at each sequence's end, reaching into the history if short.
    src = qsl[1:, None] - (K - 1) + torch.arange(K - 1, device=x.device)  # [B, K-1]
    inside = (src >= qsl[:-1, None])[..., None]
    hist_pos = ((K - 1) - (qsl[:-1, None] - src)).clamp(0, K - 2)
    from_history = history.gather(1, hist_pos[..., None].expand(-1, -1, x.shape[1]))
    state.index_copy_(0, idx, torch.where(inside, x[src.clamp(min=0)], from_history))
    return y


sconv_decode = define(
    "sconv_decode(Tensor x, Tensor(a!) state, Tensor weight, Tensor cache_indices, int layer_id=-1, int stream=-1) "
    "-> Tensor",
    fake=lambda x, *args, **kwargs: torch.empty_like(x), reference=sconv_decode_reference,
    cuda=gpu_kernel("sconv", "sconv_decode"))

sconv_extend = define(
    "sconv_extend(Tensor x, Tensor(a!) state, Tensor weight, Tensor query_start_loc, Tensor has_initial_state, "
    "Tensor cache_indices, int layer_id=-1, int stream=-1) -> Tensor",
    fake=lambda x, *args, **kwargs: torch.empty_like(x), reference=sconv_extend_reference,
    cuda=gpu_kernel("sconv", "sconv_extend"))


def sconv_verify_reference(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, cache_indices: torch.Tensor,
                           windows: torch.Tensor, layer_id: int = -1, stream: int = -1) -> torch.Tensor:
    """Speculative verification: T_d = windows.shape[1] tokens per row, x [B*T_d, D] row-major.

    Each row continues its slot's window, which is read and never written (a rejected draft must leave
    no trace). windows[b, t] ([rows, T_d, K-1, D], indexed by batch row) receives the window after the
    row's token t: the K-1 inputs ending at it, what the slot would hold had decoding stopped there.
    """
    K, B, T_d = weight.shape[1], cache_indices.shape[0], windows.shape[1]
    seq = torch.cat([state.index_select(0, cache_indices.long()), x.view(B, T_d, -1)], dim=1)  # [B, K-1+T_d, D]
    y = seq[:, K - 1:] * weight[:, K - 1]
    for back in range(1, K):
        y = y + seq[:, K - 1 - back:K - 1 - back + T_d] * weight[:, K - 1 - back]
    windows[:B] = torch.stack([seq[:, t + 1:t + K] for t in range(T_d)], dim=1)
    return y.reshape(B * T_d, -1)


def commit_conv_windows_reference(states: list[torch.Tensor], windows: list[torch.Tensor], slots: torch.Tensor,
                                  steps: torch.Tensor) -> None:
    """After a verify: for each verify row i, the window of `slots[i]` in every (stream, layer) state becomes
    the one saved after token `steps[i]` (the last accepted); a negative step leaves the slot alone.
    states[s] is one layer of a pool stream `[slots, K-1, D]`, windows[s] its draft windows
    `[rows, T_d, K-1, D]`. No host sync: a skipped row writes its slot's own window back."""
    rows = torch.arange(slots.shape[0], device=slots.device)
    target, step = slots.long(), steps.long()
    keep = (step >= 0)[:, None, None]
    for state, saved in zip(states, windows):
        state.index_copy_(0, target, torch.where(keep, saved[rows, step.clamp(min=0)], state[target]))


sconv_verify = define(
    "sconv_verify(Tensor x, Tensor state, Tensor weight, Tensor cache_indices, Tensor(a!) windows, int layer_id=-1, "
    "int stream=-1) -> Tensor",
    fake=lambda x, *args, **kwargs: torch.empty_like(x), reference=sconv_verify_reference,
    cuda=gpu_kernel("sconv", "sconv_verify"))

commit_conv_windows = define(
    "commit_conv_windows(Tensor(a!)[] states, Tensor[] windows, Tensor slots, Tensor steps) -> ()",
    fake=lambda *args: None, reference=commit_conv_windows_reference, cuda=gpu_kernel("sconv", "commit_conv_windows"))

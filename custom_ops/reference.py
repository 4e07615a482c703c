"""Plain-torch reference math for the short convolution.

These functions are the definition the custom-op kernels are tested against (bit for bit on CPU),
and the path the full-sequence forward uses. Everything is fp32; callers cast.

Tap convention (transformers' `InklingShortConvolution`, PyTorch cross-correlation): for kernel
width K, `weight[:, K-1]` multiplies the current token and `weight[:, 0]` the token K-1 steps back.
A state window holds the K-1 most recent inputs, oldest first.
"""

from __future__ import annotations

import torch


def packed_causal_conv(x: torch.Tensor, weight: torch.Tensor, seq_start: torch.Tensor,
                       window: torch.Tensor | None = None, window_row: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv over packed variable-length sequences, residual excluded.

    x: [T, C] fp32 packed tokens; weight: [C, K] fp32; seq_start: [T] int64, index of the first
    token of each token's sequence. A tap that reaches before its sequence's start reads the
    sequence's history: `window[window_row[t], K-1 - (seq_start[t] - src)]` when a window is given,
    zero otherwise.
    """
    T, K = x.shape[0], weight.shape[1]
    t = torch.arange(T, device=x.device)
    out = x * weight[:, K - 1]
    for back in range(1, K):
        src = t - back
        inside = (src >= seq_start)[:, None]
        tap = torch.where(inside, x[src.clamp(min=0)], 0.0)
        if window is not None:
            # Position in the K-1 history window: K-1 - (distance before the sequence start).
            hist_pos = (K - 1) - (seq_start - src)
            hist = window[window_row, hist_pos.clamp(0, K - 2)]
            tap = torch.where(inside, tap, torch.where((hist_pos >= 0)[:, None], hist, 0.0))
        out = out + tap * weight[:, K - 1 - back]
    return out

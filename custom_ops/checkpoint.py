"""Prefix-cache checkpoints taken by an extend step: a row's state at a page boundary inside its chunk,
saved for a later request that shares the prompt up to there.

`sconv_checkpoint` saves a conv stream's window (the K-1 inputs before the boundary) and runs before
that stream's `sconv_extend` overwrites the slot's window; `ring_checkpoint` saves a sliding layer's
ring as it stands at the boundary (the W positions before it) and runs before the chunk's keys go into
the ring. Which rows, boundaries and checkpoint slots come from the step metadata (one entry per
checkpoint, possibly none), so a compiled extend step takes any number of them with one graph. Both
references are index arithmetic over shapes only (no host reads, nothing sized by data), captured as
they are on CUDA; on CPU both have C++ kernels (one row copy per saved entry), their references'
whole-tensor gathers and selects having cost a sixth of a many-prompt prefill (`ring_checkpoint`) and
a twentieth of a long prompt's in chunks of 256 (`sconv_checkpoint`).
"""

from __future__ import annotations

import torch

from .library import define


def sconv_checkpoint_reference(x: torch.Tensor, state: torch.Tensor, saved: torch.Tensor, layer: int,
                               cache_indices: torch.Tensor, has_initial_state: torch.Tensor,
                               query_start_loc: torch.Tensor, checkpoint_rows: torch.Tensor,
                               checkpoint_ends: torch.Tensor, checkpoint_indices: torch.Tensor) -> None:
    """x [T, D] a stream's packed conv inputs (fp32), state [slots, K-1, D] its slot windows before the
    step, saved [layers, checkpoints, K-1, D] the stream's checkpoints of every layer (the whole tensor,
    not a layer's view: several ops mutating views of one tensor are not safe to compile). Checkpoint i
    of row r = checkpoint_rows[i] saves, in saved[layer, checkpoint_indices[i]], the K-1 inputs before
    packed token checkpoint_ends[i]: the row's own
    tokens from query_start_loc[r] on, and before them its slot's window (zeros for a row without
    initial state)."""
    n, K1 = checkpoint_rows.shape[0], state.shape[1]
    if n == 0 or K1 == 0:
        return
    rows = checkpoint_rows.long()
    start = query_start_loc.long()[rows][:, None]  # [n, 1]
    packed = checkpoint_ends.long()[:, None] - K1 + torch.arange(K1, device=x.device)  # [n, K-1]
    in_chunk = packed >= start
    from_chunk = x[packed.clamp(0, max(x.shape[0] - 1, 0))]
    window_at = (K1 + packed - start).clamp(0, K1 - 1)  # the window's entries before the chunk
    from_window = state[cache_indices.long()[rows][:, None], window_at]
    from_window = torch.where(has_initial_state[rows][:, None, None], from_window, 0.0)
    saved[layer, checkpoint_indices.long()] = torch.where(in_chunk[:, :, None], from_chunk, from_window).to(saved.dtype)


def ring_checkpoint_reference(k: torch.Tensor, v: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor,
                              k_saved: torch.Tensor, v_saved: torch.Tensor, layer: int, query_start_loc: torch.Tensor,
                              positions: torch.Tensor, cache_indices: torch.Tensor, checkpoint_rows: torch.Tensor,
                              checkpoint_boundaries: torch.Tensor, checkpoint_indices: torch.Tensor,
                              ring_size: int, window: int) -> None:
    """k, v [T, nkv, hd] the chunk's keys (not yet in the ring), rings [slots*R, nkv, hd], saved
    [layers, checkpoints*R, nkv, hd] (every sliding layer's, as for `sconv_checkpoint`), R = ring_size.
    Checkpoint i of row r saves, in layer `layer`, as a slot's ring holds them
    (position p at entry p % R), the `window` positions before checkpoint_boundaries[i], zero elsewhere:
    those before the chunk from the row's ring, the others from the chunk's keys."""
    n, R = checkpoint_rows.shape[0], ring_size
    if n == 0:
        return
    rows, boundary = checkpoint_rows.long(), checkpoint_boundaries.long()[:, None]
    entry = torch.arange(R, device=k.device)[None]  # [1, R]
    offset = (entry - (boundary - window)) % R
    pos = boundary - window + offset  # the position entry e holds at the boundary
    kept = (offset < window) & (pos >= 0)
    start = query_start_loc.long()[rows][:, None]
    first = positions[start]  # [n, 1]: the chunk's first position
    in_chunk = pos >= first
    at_chunk = (start + pos - first).clamp(0, max(k.shape[0] - 1, 0))
    at_ring = cache_indices.long()[rows][:, None] * R + entry
    into = (checkpoint_indices.long()[:, None] * R + entry).reshape(-1)
    for chunk, ring, saved in ((k, k_ring, k_saved), (v, v_ring, v_saved)):
        value = torch.where(in_chunk[:, :, None, None], chunk[at_chunk], ring[at_ring])
        saved[layer, into] = torch.where(kept[:, :, None, None], value, 0).to(saved.dtype).reshape(-1, *saved.shape[2:])


def _cuda(reference):
    """The reference on CUDA tensors: gathers and one scatter, capturable as they are."""
    def launch(*args):
        return reference(*args)

    launch.__name__ = launch.__qualname__ = f"checkpoint.{reference.__name__.removesuffix('_reference')}"
    return launch


sconv_checkpoint = define(
    "sconv_checkpoint(Tensor x, Tensor state, Tensor(a!) saved, int layer, Tensor cache_indices, "
    "Tensor has_initial_state, Tensor query_start_loc, Tensor checkpoint_rows, Tensor checkpoint_ends, "
    "Tensor checkpoint_indices) -> ()",
    fake=lambda *args: None, reference=sconv_checkpoint_reference, cuda=_cuda(sconv_checkpoint_reference))

ring_checkpoint = define(
    "ring_checkpoint(Tensor k, Tensor v, Tensor k_ring, Tensor v_ring, Tensor(a!) k_saved, Tensor(b!) v_saved, "
    "int layer, Tensor query_start_loc, Tensor positions, Tensor cache_indices, Tensor checkpoint_rows, "
    "Tensor checkpoint_boundaries, Tensor checkpoint_indices, int ring_size, int window) -> ()",
    fake=lambda *args: None, reference=ring_checkpoint_reference, cuda=_cuda(ring_checkpoint_reference))

"""The drafter that runs Inkling's multi-token-prediction head (`model.MtpHead`) beside the engine.

The head's recipe (`docs inkling-mtp.md` §3, where the public implementations agree): depth m (1-based) at
position q takes `prev`, the target's final-normed hidden h_q for m = 1 or depth m-1's output at q, and
the token x_{q+m}; it fuses `input_proj(cat[hidden_norm(prev), embed_norm(E(x))])` (E = the trunk's
embedding with its own embed norm; hidden first unless `mtp_hidden_states_first` is false), runs one
full Inkling decoder layer (dense MLP; sliding where `mtp_local_layer_ids` says, else global), applies
`chain_norm` when the checkpoint has one, and predicts x_{q+m+1} with the trunk's lm_head(out / mup).
The next depth chains on that output. Each depth has its own conv windows and keys.

`MtpDrafter` keeps every depth's state exact: a depth's state at position q is extended only once the
token it consumes there, x_{q+m}, is known for certain, so depth m lags the sequence by m positions.
To draft from anchor P-1 (P: position of the newest token) each depth runs its missing positions with
the drafts it needs, reading its state and writing none of it.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from ..attention import attend
from ..config import InklingConfig, LayerGeometry
from ..custom_ops.reference import packed_causal_conv
from ..errors import OptionError
from ..model import MtpHead
from ..streams import MODEL_STREAMS
from .drafter import Drafter


@dataclasses.dataclass
class _Rows:
    """One packed call of one depth: per row its slot, first position and token count."""

    slots: list[int]
    firsts: list[int]
    counts: list[int]


class DepthState:
    """One depth's state for every slot: conv windows per model stream `[slots, K-1, D]` and keys and values
    by position `[slots, max_len, nkv, hd]` (dense per slot: the head is one layer, its keys are few)."""

    def __init__(self, geometry: LayerGeometry, config: InklingConfig, slots: int, max_len: int, dtype, device):
        K, H = config.conv_kernel_size, config.hidden_size
        widths = {0: geometry.kv_width, 1: geometry.kv_width, 2: H, 3: H}
        self.conv = {s: torch.zeros(slots, K - 1, widths[s], dtype=torch.float32, device=device)
                     for s in MODEL_STREAMS}
        shape = (slots, max_len, geometry.num_kv_heads, geometry.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    def clear(self, slot: int) -> None:
        for t in self.conv.values():
            t[slot].zero_()


class DepthContext:
    """The forward context of one depth over packed rows, each continuing its slot's history from the row's
    first position. With `persist` the rows' conv windows and keys enter the state; without, the call
    reads the state and changes nothing (a draft run). Eager only."""

    def __init__(self, state: DepthState, config: InklingConfig, rows: _Rows, starts: list[int], persist: bool):
        self.state, self.config, self.rows, self.starts, self.persist = state, config, rows, starts, persist
        device = state.keys.device
        counts = torch.tensor(rows.counts, device=device)
        offsets = torch.tensor(list(itertools.accumulate([0] + rows.counts[:-1])), device=device)
        self.row_of_token = torch.repeat_interleave(torch.arange(len(rows.counts), device=device), counts)
        self.seq_start = offsets[self.row_of_token]
        self.positions = torch.cat([torch.arange(f, f + n, device=device) for f, n in zip(rows.firsts, rows.counts)])
        self.slots = torch.tensor(rows.slots, dtype=torch.long, device=device)
        self.spans = list(zip(offsets.tolist(), (offsets + counts).tolist()))

    def enter_layer(self, layer_id: int) -> None:
        """The head's state is the drafter's own: nothing to wait for."""

    def short_conv(self, x32: torch.Tensor, weight: torch.Tensor, layer_id: int, stream: int) -> torch.Tensor:
        windows = self.state.conv[stream]
        history = windows[self.slots]  # [rows, K-1, D]
        y = packed_causal_conv(x32, weight, self.seq_start, history, self.row_of_token)
        if self.persist:
            K = weight.shape[1]
            for row, (start, end) in enumerate(self.spans):
                windows[self.slots[row]] = torch.cat([history[row], x32[start:end]])[-(K - 1):]
        return y

    def attention(self, layer_id: int, g: LayerGeometry, q, k, v, r, rel_proj) -> torch.Tensor:
        table = r @ rel_proj
        outs = []
        for row, (start, end) in enumerate(self.spans):
            slot, first, begin = self.rows.slots[row], self.rows.firsts[row], self.starts[row]
            if g.sliding:
                begin = max(begin, first - g.window + 1)
            keys = torch.cat([self.state.keys[slot, begin:first], k[start:end]])
            values = torch.cat([self.state.values[slot, begin:first], v[start:end]])
            if self.persist:
                self.state.keys[slot, first:first + end - start] = k[start:end]
                self.state.values[slot, first:first + end - start] = v[start:end]
            pos = self.positions[start:end]
            k_pos = torch.arange(begin, first + end - start, device=q.device)
            tau = self.config.log_scale(pos)[None] if g.log_scaling else None
            mask = torch.ones(1, end - start, len(k_pos), dtype=torch.bool, device=q.device)
            outs.append(attend(q[None, start:end], keys[None], values[None], table[None, start:end], q_pos=pos[None],
                               k_pos=k_pos[None], key_mask=mask, tau=tau, window=g.window or 0,
                               rel_extent=g.rel_extent)[0])
        return torch.cat(outs)


@dataclasses.dataclass(eq=False)
class _Track:
    """What the drafter knows of one request: the first position its head history covers (past a prefix
    cache hit, the cached tokens have no target hidden), per depth the positions its state covers, and the
    inputs waiting for each depth (level 0: the target's hidden by position; level m: depth m's output)."""

    slot: int
    start: int
    done: list[int]
    pending: list[dict[int, torch.Tensor]]


class MtpDrafter(Drafter):
    """Drafts with the checkpoint's MTP head: depth m proposes the m-th token ahead (greedy, so the draft
    is a point mass: rejection sampling stays exact). Needs the engine's hidden states."""

    needs_hidden = True
    extend_chunk = 256  # positions one depth takes in per row and call (a long prompt arrives all at once)

    def __init__(self, model, num_tokens: int):
        head: MtpHead | None = getattr(model.model, "mtp", None)
        if head is None:
            raise OptionError("speculative='mtp' needs the checkpoint's MTP head: load the model with "
                              "Engine.from_pretrained(..., speculative='mtp') from a checkpoint that has one")
        if num_tokens > len(head.layers):
            raise OptionError(f"num_speculative_tokens={num_tokens} exceeds the {len(head.layers)} MTP depth(s) "
                              "loaded: the MTP head drafts one token per depth")
        self.model, self.head, self.num_tokens = model, head, num_tokens
        self.depths = num_tokens
        self.states: list[DepthState] = []
        self.tracks: dict[object, _Track] = {}

    def attach(self, pool, max_model_len: int) -> None:
        config, weight = self.head.block_config, self.model.lm_head.weight
        self.slot_of = pool.slot_of
        self.states = [DepthState(config.geometry(i), config, pool.max_slots + 1, max_model_len, self.model.dtype,
                                  weight.device) for i in range(self.depths)]

    def release(self, req) -> None:
        self.tracks.pop(req, None)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for s in self.states for t in (*s.conv.values(), s.keys, s.values)]

    # ---- what the target did ----------------------------------------------------------------------

    def observe_prefill(self, reqs: list, lengths: list[int], hidden: torch.Tensor | None) -> None:
        for req, start, n in zip(reqs, itertools.accumulate([0] + lengths), lengths):
            track = self.tracks.get(req)
            if track is None:
                slot = self.slot_of[req.request_id]
                track = self.tracks[req] = _Track(slot, req.prefilled, [req.prefilled] * self.depths,
                                                  [{} for _ in range(self.depths)])
                for state in self.states:
                    state.clear(slot)
            rows = hidden[start:start + n].clone()  # its own copy: the packed step output can go
            for j in range(n):
                track.pending[0][req.prefilled + j] = rows[j]

    def observe_tokens(self, reqs: list, emitted: list[int], hidden: torch.Tensor | None) -> None:
        for i, (req, n) in enumerate(zip(reqs, emitted)):
            track = self.tracks.get(req)
            if track is None or req.finish_reason is not None:
                continue
            first = len(req.prompt) + len(req.output) - 1 - n  # position of the step's first input
            for j in range(n):
                track.pending[0][first + j] = hidden[i, j]

    # ---- drafting ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, reqs: list) -> list[list[int] | None]:
        live = [(r, self.tracks[r]) for r in reqs if r in self.tracks]
        sequences = {r: r.prompt + r.output for r, _ in live}  # every token known for certain, per request
        drafts: dict[object, list[int]] = {r: [] for r, _ in live}
        previous_run: dict[object, dict[int, torch.Tensor]] = {}  # the last depth's draft-run outputs
        for index in range(self.depths):
            m = index + 1
            outputs = self._extend(index, live, sequences)
            runs = []
            for req, track in live:
                if len(drafts[req]) < index:
                    continue  # an earlier depth could not draft for it
                known = sequences[req]
                P = len(known) - 1  # the newest token's position; depth m drafts x_{P+m} from position P-1
                first = track.done[index]  # positions first..P-1 are not in the state yet: run them
                prev = [track.pending[index].get(q, previous_run.get(req, {}).get(q)) for q in range(first, P)]
                if prev and all(h is not None for h in prev):
                    tokens = [known[q + m] if q + m <= P else drafts[req][q + m - P - 1] for q in range(first, P)]
                    runs.append((req, track, first, prev, tokens))
            previous_run = {}
            for (req, _, first, _, _), out in zip(runs, self._run(index, runs, persist=False) if runs else []):
                previous_run[req] = {first + j: h for j, h in enumerate(out)}
                outputs.setdefault(req, {}).update(previous_run[req])
            anchors = [(req, outputs[req][len(sequences[req]) - 2]) for req, _ in live
                       if len(sequences[req]) - 2 in outputs.get(req, {})]
            if anchors:
                logits = self.model.logits(torch.stack([h for _, h in anchors]))
                for (req, _), token in zip(anchors, logits.argmax(-1).tolist()):
                    drafts[req].append(token)
        return [drafts.get(r) or None for r in reqs]

    def _extend(self, index: int, live: list, sequences: dict) -> dict[object, dict[int, torch.Tensor]]:
        """Depth `index` takes in every position whose inputs are all known for certain, `extend_chunk`
        positions per row and call: its state grows, its outputs wait for the next depth. Returns the
        outputs by request and position."""
        outputs: dict[object, dict[int, torch.Tensor]] = {}
        while chunk := self._extend_chunk(index, live, sequences):
            for req, taken in chunk.items():
                outputs.setdefault(req, {}).update(taken)
        return outputs

    def _extend_chunk(self, index: int, live: list, sequences: dict) -> dict[object, dict[int, torch.Tensor]]:
        m = index + 1
        runs = []
        for req, track in live:
            known = sequences[req]
            first, prev = track.done[index], []
            while len(prev) < self.extend_chunk and first + len(prev) + m < len(known) \
                    and first + len(prev) in track.pending[index]:
                prev.append(track.pending[index][first + len(prev)])
            if prev:
                runs.append((req, track, first, prev, known[first + m:first + m + len(prev)]))
        if not runs:
            return {}
        outputs = {}
        for (req, track, first, prev, tokens), out in zip(runs, self._run(index, runs, persist=True)):
            for j in range(len(tokens)):
                del track.pending[index][first + j]
                if index + 1 < self.depths:
                    track.pending[index + 1][first + j] = out[j]
            track.done[index] = first + len(tokens)
            outputs[req] = {first + j: h for j, h in enumerate(out)}
        return outputs

    def _run(self, index: int, runs: list, persist: bool) -> list[torch.Tensor]:
        rows = _Rows([t.slot for _, t, _, _, _ in runs], [f for _, _, f, _, _ in runs], [len(p) for _, _, _, p, _ in runs])
        prev = torch.stack([h for _, _, _, p, _ in runs for h in p])
        tokens = torch.tensor([x for *_, toks in runs for x in toks], device=prev.device)
        ctx = DepthContext(self.states[index], self.head.block_config, rows, [t.start for _, t, _, _, _ in runs],
                           persist)
        out = self.head.depth(index, prev, self.model.model.embed_tokens(tokens), ctx)
        return list(out.split(rows.counts))

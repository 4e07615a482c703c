"""State pool layout and ownership, the one StepMetadata per step, and the static pool-access scan."""

import random
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from inkling_compiled.cache import StatePool
from inkling_compiled.config import InklingConfig
from inkling_compiled.engine import Engine
from inkling_compiled.metadata import BUFFER_SPECS, GREEDY_PAD
from inkling_compiled.sampling import SamplingParams
from inkling_compiled.streams import ATTN_STREAM, K_STREAM, MLP_STREAM, MODEL_STREAMS, V_STREAM
from inkling_compiled.tiny import TINY_CONFIGS

from conftest import random_prompt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import scan_pool_access  # noqa: E402


def tiny_pool(name="tiny", **kw):
    config = InklingConfig.from_dict({"model_type": "inkling_text", **TINY_CONFIGS[name]})
    args = dict(max_slots=4, num_pages=9, page_size=4, max_pages_per_seq=4, dtype=torch.float32,
                spec_draft_tokens=2)
    args.update(kw)
    return config, StatePool(config, **args)


def test_backend_slices_are_the_pool_tensors_themselves(checkpoint):
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=4)
    config, pool, context = engine.config, engine.worker.pool, engine.worker.backend.context
    sliding = [i for i, t in enumerate(config.layer_types) if t == "hybrid_sliding"]
    glob = [i for i, t in enumerate(config.layer_types) if t == "hybrid"]
    pairs = 0
    for layer in range(config.num_hidden_layers):
        kind, same_kind = ("sliding", sliding) if layer in sliding else ("global", glob)
        expect = {K_STREAM: ("k_" + kind, same_kind.index(layer)), V_STREAM: ("v_" + kind, same_kind.index(layer)),
                  ATTN_STREAM: ("attn", layer), MLP_STREAM: ("mlp", layer)}
        for stream in MODEL_STREAMS:
            name, index = expect[stream]
            for got, base in ((context.sconv_state(layer, stream), pool.conv[name]),
                              (context.sconv_intermediate_window(layer, stream), pool.intermediate_conv_window[name])):
                direct = base[index]
                assert (got.data_ptr(), got.shape, got.stride()) == (direct.data_ptr(), direct.shape, direct.stride())
                pairs += 1
    assert pairs == 2 * 4 * config.num_hidden_layers


def test_streams_are_allocated_only_for_the_layers_that_use_them():
    config, pool = tiny_pool("tiny-k3")  # layer types: global, sliding, sliding
    def shapes(layers):
        return [tuple(t.shape) for t in layers]

    assert shapes(pool.conv["k_global"]) == [(5, 2, 2 * 8)]
    assert shapes(pool.conv["k_sliding"]) == [(5, 2, 3 * 16)] * 2
    assert shapes(pool.conv["attn"]) == [(5, 2, 48)] * 3
    assert shapes(pool.global_kv[0]) == [(9 * 4, 2, 8)]
    # (slots + dummy) * ring, the ring one entry longer than the window of 5: a 2-token verify step
    assert pool.ring_size == 6 and shapes(pool.sliding_kv[0]) == [(5 * 6, 3, 16)] * 2
    assert shapes(pool.intermediate_conv_window["mlp"]) == [(5, 2, 2, 48)] * 3
    # one allocation per layer: no state tensor is a view of another
    storages = [t.untyped_storage().data_ptr() for t in pool.static_tensors()]
    assert len(set(storages)) == len(storages)


def test_slot_and_page_zero_are_never_handed_out():
    _, pool = tiny_pool()
    slots = [pool.allocate(f"r{i}", 8) for i in range(4)]
    assert sorted(slots) == [1, 2, 3, 4]
    assert all(0 not in pool.pages_of[f"r{i}"] for i in range(4))
    assert not pool.can_admit(1)


def test_allocation_clears_the_slot_and_fills_the_block_table():
    config, pool = tiny_pool()
    W = pool.ring_size
    convs = [t for layers in pool.conv.values() for t in layers]
    rings = [t for layers in pool.sliding_kv for t in layers]
    for t in convs + rings:
        t.fill_(7.0)
    slot = pool.allocate("a", 9)  # 3 pages of 4
    assert all(t[slot].abs().sum() == 0 for t in convs)
    assert all(t[2].eq(7.0).all() for t in convs)  # other slots untouched
    # the slot's sliding-window rings too: nothing of the slot's last request may be read
    assert all(t[slot * W:(slot + 1) * W].abs().sum() == 0 for t in rings)
    assert all(t[:slot * W].eq(7.0).all() and t[(slot + 1) * W:].eq(7.0).all() for t in rings)
    assert pool.block_table[slot, :3].tolist() == pool.pages_of["a"] and pool.block_table[slot, 3] == 0
    pool.free("a")
    assert pool.block_table[slot].abs().sum() == 0


def test_thousand_random_events_leak_nothing(checkpoint):
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=4, max_model_len=48, page_size=4)
    rng = random.Random(0)
    live = []
    for event in range(1000):
        kind = rng.random()
        if kind < 0.4:
            live.append(engine.add_request(random_prompt(rng.randint(1, 30), seed=event),
                                           SamplingParams(max_new_tokens=rng.randint(1, 6), ignore_eos=True)))
        elif kind < 0.55 and live:
            engine.abort(live.pop(rng.randrange(len(live))))  # live: no finished output seen yet
        else:
            for out in engine.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
        busy = len(engine.scheduler.running)
        assert engine.worker.pool.slots.num_free == engine.worker.pool.slots.capacity - busy
    while engine.has_unfinished():
        engine.step()
    assert engine.worker.pool.slots.num_free == engine.worker.pool.slots.capacity
    engine.clear_prefix_cache()  # cached prompt pages are held on purpose; the rest must be free
    assert engine.worker.pool.pages.num_free == engine.worker.pool.pages.capacity
    assert not engine.worker.pool.slot_of and not engine.worker.pool.pages_of
    assert engine.worker.pool.block_table.abs().sum() == 0


class ConvCallRecorder(TorchDispatchMode):
    """Records what every sconv op call actually receives: its cache_indices object and values, and the
    address of the state slice it mutates."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.inkling.sconv_decode.default:
            x, state, weight, cache_indices, layer, stream = args
            self.calls.append((id(cache_indices), cache_indices.tolist(), state.data_ptr(), layer, stream))
        return func(*args, **(kwargs or {}))


def test_every_conv_of_a_step_reads_the_one_metadata_object_and_its_own_pool_slice(checkpoint):
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=4)
    backend, model, pool = engine.worker.backend, engine.model, engine.worker.pool
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=1))  # warm the pool with real requests
    buffer = backend.buffers.decode_region.bytes
    addresses = None
    objects = set()
    for step, (slots, lens) in enumerate((([1, 2], [3, 7]), ([2, 1], [4, 8]), ([1, 2], [5, 9]))):
        md = backend.prepare_decode([11, 12], slots, lens, [GREEDY_PAD] * 2)
        with torch.inference_mode(), ConvCallRecorder() as recorder:
            model.hidden_states(md.input_ids, backend.context)
        layers = engine.config.num_hidden_layers
        assert len(recorder.calls) == 4 * layers
        assert {c[0] for c in recorder.calls} == {id(md.cache_indices)}  # one object, read by every conv
        assert all(c[1] == slots for c in recorder.calls)  # holding this step's slots
        want = {}
        for layer in range(layers):
            for stream in MODEL_STREAMS:
                name, index = pool.streams.locate(layer, stream)
                want[(layer, stream)] = pool.conv[name][index].data_ptr()
        assert {(c[3], c[4]): c[2] for c in recorder.calls} == want  # each conv its own (layer, stream) slice
        objects.add(id(md))
        fields = {name: getattr(md, name) for name in BUFFER_SPECS}
        for t in (t for t in fields.values() if t.numel()):  # every field with entries lies in the one static buffer
            assert buffer.data_ptr() <= t.data_ptr() < buffer.data_ptr() + buffer.numel()
        # and the same shape of step finds its fields where the last one did
        assert addresses in (None, {n: t.data_ptr() for n, t in fields.items()})
        addresses = {n: t.data_ptr() for n, t in fields.items()}
    assert len(objects) == 1


def test_buffers_never_grow(checkpoint):
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=2, prefill_chunk_tokens=8)
    with pytest.raises(ValueError, match="max_batch_size=2"):
        engine.worker.backend.prepare_decode([1, 2, 3], [1, 2, 3], [0, 0, 0], [GREEDY_PAD] * 3)
    # a prompt budget of 8, and a token for each running row beside it (a mixed step): 10 fit, 11 do not
    engine.worker.backend.prepare_prefill([[5] * 10], [1], [GREEDY_PAD])
    with pytest.raises(ValueError, match="max_tokens=10"):
        engine.worker.backend.prepare_prefill([[5] * 11], [1], [GREEDY_PAD])


def test_static_scan_is_clean_and_catches_violations():
    assert scan_pool_access.scan_paths(scan_pool_access.DEFAULT_PATHS) == []
    bad = (
        "class B:\n"
        "    def prepare_decode(self, batch):\n"
        "        s = self.sconv_state(0, 1)\n"
        "    def __init__(self, pool):\n"
        "        self.cached = pool.conv['attn'][0]\n"
        "        self.view = self.kv_cache(3)\n"
    )
    problems = scan_pool_access.scan_source(bad, "bad.py")
    assert len(problems) == 3
    assert "metadata prep `prepare_decode` calls pool accessor `sconv_state`" in problems[0]
    assert any("conv[...]" in p and "`cached`" in p for p in problems)
    assert any("kv_cache()" in p and "`view`" in p for p in problems)


class CopyCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            self.copies.append((args[0].device.type, args[1].device.type, args[0].numel()))
        elif func is torch.ops.aten._to_copy.default and args[0].device != kwargs.get("device", args[0].device):
            self.copies.append((str(kwargs["device"]), args[0].device.type, args[0].numel()))
        return func(*args, **kwargs)


@pytest.mark.parametrize("staged", [False, True])
def test_a_decode_step_fills_every_field_as_a_plain_loop_would(staged):
    """Decode prep packs Python lists into the buffer a field at a time: each field against values computed
    here row by row from the block table, padding rows included, after a prefill used the other region."""
    from inkling_compiled.metadata import RowSampling, StepBuffers

    config, pool = tiny_pool()
    g = torch.Generator().manual_seed(3)
    pool.block_table_host.copy_(torch.randint(1, 9, pool.block_table_host.shape, generator=g))
    buffers = StepBuffers(config, pool.block_table_host, page_size=4, max_batch_size=4, max_tokens=64, staged=staged)
    buffers.prepare_prefill([[5] * 12, [6] * 10], [1, 2], [GREEDY_PAD] * 2)
    # a full step first, so that a padding row left unwritten would keep its values
    buffers.prepare_decode([1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 14], [RowSampling(0.5, 2, 0.5, 9, 9)] * 4)
    ids, slots, lens = [17, 3, 250], [3, 1, 2], [13, 0, 9]
    sampling = [RowSampling(0.7, 5, 0.9, 2**40 + 1, 12), RowSampling(0.0, 0, 1.0, 0, 0), RowSampling(1.3, 1, 0.25, 7, 3)]
    md = buffers.prepare_decode(ids, slots, lens, sampling, pad_to=4)
    ring = buffers.ring_size
    slot, pos = slots + [0], lens + [0]
    want = {
        "input_ids": ids + [0], "cache_indices": slot, "positions": pos, "seq_lens": [p + 1 for p in pos],
        "query_start_loc": [0, 1, 2, 3, 4], "last_token_index": [0, 1, 2, 3],
        "has_initial_state": [s > 0 for s in slot],
        "global_kv_loc": [int(pool.block_table_host[s, p // 4]) * 4 + p % 4 for s, p in zip(slot, pos)],
        "sliding_kv_loc": [s * ring + p % ring for s, p in zip(slot, pos)],
        "top_k": [5, 0, 1, 0], "seed": [2**40 + 1, 0, 7, 0], "sample_counter": [12, 0, 3, 0]}
    for name, values in want.items():
        assert getattr(md, name).tolist() == values, name
    for name, values in (("temperature", [0.7, 0.0, 1.3, 0.0]), ("top_p", [0.9, 1.0, 0.25, 1.0])):
        assert torch.equal(getattr(md, name), torch.tensor(values, dtype=torch.float32)), name


@pytest.mark.parametrize("staged", [False, True])
def test_a_verify_step_fills_every_field_as_a_plain_loop_would(staged):
    """Verify prep, packed a field at a time like decode's: each field against values computed here token
    by token (K=2), a row whose last tokens pass its limit (the dummy page, no ring entry, read at the
    limit's position) and a padding row included, after a full verify step and a prefill used the buffers."""
    from inkling_compiled.metadata import RowSampling, StepBuffers

    config, pool = tiny_pool()
    g = torch.Generator().manual_seed(4)
    pool.block_table_host.copy_(torch.randint(1, 9, pool.block_table_host.shape, generator=g))
    buffers = StepBuffers(config, pool.block_table_host, page_size=4, max_batch_size=4, max_tokens=64, staged=staged,
                          draft_tokens=2)
    buffers.prepare_verify([[9, 9, 9]] * 4, [1, 2, 3, 4], [5, 6, 7, 8], [99] * 4, [2] * 4,
                           [RowSampling(0.5, 2, 0.5, 9, 9)] * 4)
    buffers.prepare_prefill([[5] * 12, [6] * 10], [1, 2], [GREEDY_PAD] * 2)
    tokens, slots, lens, limits, drafted = [[17, 3, 250], [4, 5, 6], [7, 8, 9]], [3, 1, 2], [13, 0, 9], [99, 99, 10], [2, 0, 1]
    sampling = [RowSampling(0.7, 5, 0.9, 2**40 + 1, 12), RowSampling(0.0, 0, 1.0, 0, 0), RowSampling(1.3, 1, 0.25, 7, 3)]
    md = buffers.prepare_verify(tokens, slots, lens, limits, drafted, sampling, pad_to=4)
    ring, page = buffers.ring_size, 4
    slot, first, limit = slots + [0], lens + [0], limits + [1]
    positions, global_loc, sliding_loc = [], [], []
    for s, p0, end in zip(slot, first, limit):
        for p in (p0, p0 + 1, p0 + 2):
            kept = p < end
            positions.append(p if kept else end - 1)
            global_loc.append(int(pool.block_table_host[s, p // page]) * page + p % page if kept
                              else int(pool.block_table_host[0, 0]) * page)
            sliding_loc.append(s * ring + p % ring if kept else -1)
    want = {
        "input_ids": [17, 3, 250, 4, 5, 6, 7, 8, 9, 0, 0, 0], "cache_indices": slot, "positions": positions,
        "seq_lens": [p + 1 for p in first], "query_start_loc": [0, 3, 6, 9, 12], "last_token_index": [2, 5, 8, 11],
        "has_initial_state": [s > 0 for s in slot], "drafted": [2, 0, 1, 0],
        "global_kv_loc": global_loc, "sliding_kv_loc": sliding_loc,
        "top_k": [5, 0, 1, 0], "seed": [2**40 + 1, 0, 7, 0], "sample_counter": [12, 0, 3, 0]}
    assert md.draft_tokens == 2 and not md.is_decode
    for name, values in want.items():
        assert getattr(md, name).tolist() == values, name
    for name, values in (("temperature", [0.7, 0.0, 1.3, 0.0]), ("top_p", [0.9, 1.0, 0.25, 1.0])):
        assert torch.equal(getattr(md, name), torch.tensor(values, dtype=torch.float32)), name
    with pytest.raises(ValueError, match="a verify step takes 3 tokens"):  # a row of the wrong length
        buffers.prepare_verify([[1, 2]], [1], [3], [99], [1], [GREEDY_PAD])


@pytest.mark.parametrize("ids, slots, lens, rows, pad_to", [
    ([1, 2], [1], [3], 1, None), ([1], [1, 2], [3, 4], 2, None), ([1, 2], [1, 2], [3], 2, None),
    ([1, 2], [1, 2], [3, 4], 1, None), ([1, 2, 3], [1, 2, 3], [3, 4, 5], 3, 2)])
def test_a_decode_step_whose_lists_disagree_is_refused(ids, slots, lens, rows, pad_to):
    """Packed a field at a time, a longer list would run into the next field: refused by name instead."""
    from inkling_compiled.metadata import StepBuffers

    config, pool = tiny_pool()
    buffers = StepBuffers(config, pool.block_table_host, page_size=4, max_batch_size=4, max_tokens=64)
    with pytest.raises(ValueError, match="a decode step takes a token, a position and sampling per slot"):
        buffers.prepare_decode(ids, slots, lens, [GREEDY_PAD] * rows, pad_to=pad_to)


def test_a_staged_step_moves_its_metadata_in_one_copy():
    """Off the CPU the fields are written on the host and moved by one copy per step, of only the bytes
    the step uses (staged=True gives CPU buffers the host copy a GPU's have)."""
    from inkling_compiled.metadata import StepBuffers

    config, pool = tiny_pool()
    buffers = StepBuffers(config, pool.block_table_host, page_size=4, max_batch_size=4, max_tokens=64, staged=True)
    with CopyCounter() as counter:
        decode = buffers.prepare_decode([7, 8], [1, 2], [3, 5], [GREEDY_PAD] * 2, pad_to=4)
    assert decode.input_ids.tolist() == [7, 8, 0, 0] and decode.seq_lens.tolist() == [4, 6, 1, 1]  # arrived
    assert len(counter.copies) == 1
    small = counter.copies[0][2]
    with CopyCounter() as counter:
        buffers.prepare_prefill([[5] * 12, [6] * 10], [1, 2], [GREEDY_PAD] * 2)
    assert len(counter.copies) == 1
    assert small < counter.copies[0][2] < buffers.prefill_region.bytes.numel()  # only what the step uses
    # every field of both steps lies in its region's buffer
    for region in (buffers.decode_region, buffers.prefill_region):
        base, end = region.staging.data_ptr(), region.staging.data_ptr() + region.staging.numel()
        assert all(base <= h.ctypes.data < end for h in region.host.values())


def test_verify_outputs_come_back_in_rows_as_a_plain_loop_reads_them():
    """A verify step's outputs on the host, read in place on the CPU (`sampled`) and packed in one copy as
    off it (`to_host`), against a loop over the tensors' elements: each row's K+1 tokens, logprobs and
    tops cut to n, and its accepted count."""
    from inkling_compiled.runner import VerifyOutput

    g = torch.Generator().manual_seed(1)
    B, T = 3, 4
    out = VerifyOutput(torch.randint(0, 2**40, (B, T), generator=g), torch.tensor([0, 3, 1]), torch.randn(B, T, generator=g),
                       torch.randint(0, 5000, (B, T, 20), generator=g), torch.randn(B, T, 20, generator=g))
    for n in (0, 1, 5):
        rows = [[[out.top_ids[b, t, j].item() for j in range(n)] for t in range(T)] for b in range(B)]
        vals = [[[out.top_logprobs[b, t, j].item() for j in range(n)] for t in range(T)] for b in range(B)]
        got = out.sampled(n)
        assert got.tokens == [[out.tokens[b, t].item() for t in range(T)] for b in range(B)]
        assert got.logprobs == [[out.chosen_logprobs[b, t].item() for t in range(T)] for b in range(B)]
        assert (got.top_ids, got.top_logprobs, got.accepted) == (rows, vals, [0, 3, 1])
        accepted, flat = out.to_host(n, one_copy=True)
        assert accepted == [0, 3, 1] and flat.tokens == [t for row in got.tokens for t in row]
        assert flat.chosen_logprobs == [c for row in got.logprobs for c in row]
        assert flat.top_ids == [t for row in rows for t in row] and flat.top_logprobs == [v for row in vals for v in row]


def test_step_outputs_come_back_in_one_copy_and_exactly():
    """Token ids and logprobs packed into one float64 transfer survive it bit for bit, and off the CPU
    that transfer is the only copy (the meta device stands in for a GPU: it has no values to list)."""
    from inkling_compiled.runner import StepOutput

    g = torch.Generator().manual_seed(0)
    out = StepOutput(torch.tensor([5, 2**40 + 3, 262_143]), torch.randn(3, generator=g),
                     torch.randint(0, 2**31, (3, 20), generator=g), torch.randn(3, 20, generator=g))
    want = out.to_host(4)  # CPU: read directly
    assert want[0] == [5, 2**40 + 3, 262_143] and len(want[2][0]) == 4
    assert out.to_host(4, one_copy=True) == want
    assert out.to_host(0) == out.to_host(0, one_copy=True) == (want[0], want[1], [[], [], []], [[], [], []])
    packed = StepOutput(*(t.to("meta") for t in (out.tokens, out.chosen_logprobs, out.top_ids, out.top_logprobs)))
    with CopyCounter() as counter:
        try:
            packed.to_host(4)
        except NotImplementedError:  # meta tensors have no values to list; the copy is what is counted
            pass
    assert len(counter.copies) == 1

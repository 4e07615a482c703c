"""Speculative decoding: verify ops and commit, acceptance (greedy exact, sampling in distribution),
drafters, and the engine against transformers and against itself without speculation."""

import numpy as np
import pytest
import torch

from inkling_compiled.engine import Engine
from inkling_compiled.errors import OptionError
from inkling_compiled.sampling import SamplingParams, verify_drafts
from inkling_compiled.spec import Drafter, NgramDrafter
from inkling_compiled.step_plan import StepKind
from inkling_compiled.streams import MODEL_STREAMS

from conftest import Threes, has_symbolic_batch, random_prompt

GREEDY = SamplingParams(max_new_tokens=14, logprobs=True, ignore_eos=True)


class ScriptedDrafter(Drafter):
    """Proposes each request's known greedy continuation with the draft at index `miss(req, step)` made
    wrong, so a row accepts exactly that many drafts: rows of one step accept different counts."""

    def __init__(self, continuations: dict[tuple, list[int]], miss):
        self.continuations, self.miss, self.steps = continuations, miss, 0

    def propose(self, reqs):
        self.steps += 1
        drafts = []
        for row, req in enumerate(reqs):
            known = self.continuations[tuple(req.prompt)]
            draft = list(known[len(req.output):len(req.output) + self.num_tokens])
            draft += [3] * (self.num_tokens - len(draft))
            wrong = self.miss(row, self.steps)
            if wrong < self.num_tokens:
                draft[wrong] = (draft[wrong] + 1) % 250 + 3
            drafts.append(draft)
        return drafts


def engine_for(checkpoint, name="tiny", **kw):
    return Engine.from_pretrained(checkpoint(name), compile=kw.pop("compile", False), progress=False, **kw)


@pytest.fixture(scope="module")
def plain_outputs(checkpoint):
    """Non-speculative greedy outputs (eager), per config and prompt."""
    engines, cache = {}, {}

    def get(name, prompts, params=GREEDY):
        key = (name, tuple(map(tuple, prompts)), params)
        if key not in cache:
            engine = engines.setdefault(name, engine_for(checkpoint, name, max_batch_size=8, max_model_len=128))
            cache[key] = engine.generate(prompts, params)
        return cache[key]

    return get


# ---- ops ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("strided", [False, True], ids=["rows", "strided-rows"])
@pytest.mark.parametrize("kernel", ["op", "reference"])
@pytest.mark.parametrize("K", [3, 4])
def test_verify_windows_and_commit_equal_decoding_the_accepted_tokens(K, kernel, strided):
    """sconv_verify leaves the slots alone and saves each token's window; committing step s gives the state
    that decoding tokens 0..s one at a time leaves (bit for bit), whatever each row accepted. `op` is the
    CPU (C++) kernel, whose outputs also equal the reference's bit for bit."""
    from inkling_compiled.custom_ops import KERNELS

    verify, commit = ((torch.ops.inkling.sconv_verify, torch.ops.inkling.commit_conv_windows) if kernel == "op" else
                      (KERNELS["sconv_verify"]["reference"], KERNELS["commit_conv_windows"]["reference"]))
    g = torch.Generator().manual_seed(0)
    T_d, D, slots = 4, 6, 6
    state = torch.randn(slots, K - 1, D, generator=g)
    # strided: the rows apart, as k and v of q/k/v/r lie; and the taps by position, as the loader holds them
    weight = torch.randn(K, D, generator=g).t() if strided else torch.randn(D, K, generator=g)
    rows = torch.tensor([3, 1, 5, 2], dtype=torch.int32)
    x = torch.randn(len(rows) * T_d, D + 5 * strided, generator=g)[:, :D]
    windows = torch.zeros(slots, T_d, K - 1, D)
    before = state.clone()
    y = verify(x, state, weight, rows, windows)
    assert torch.equal(state, before)
    reference_windows = torch.zeros_like(windows)
    assert torch.equal(y, KERNELS["sconv_verify"]["reference"](x, state, weight, rows, reference_windows))
    assert torch.equal(windows, reference_windows)

    decoded = state.clone()
    want_y, want_windows = [], []
    for t in range(T_d):
        want_y.append(torch.ops.inkling.sconv_decode(x.reshape(len(rows), T_d, D)[:, t].contiguous(), decoded, weight, rows))
        want_windows.append(decoded[rows.long()].clone())
    assert torch.allclose(y.view(len(rows), T_d, D), torch.stack(want_y, 1), atol=1e-6)

    steps = torch.tensor([0, 3, -1, 1])  # rows accept 0, 3, (finished: left alone), 1 drafts
    pool = [state.clone(), state.clone()]  # a pool stream of two layers, one tensor each, the second's windows +1
    commit(pool, [windows, windows + 1], rows, steps)
    for i, (slot, step) in enumerate(zip(rows.tolist(), steps.tolist())):
        want = before[slot] if step < 0 else want_windows[step][i]
        assert torch.equal(pool[0][slot], want) and torch.equal(pool[1][slot], want + (step >= 0))
    untouched = [s for s in range(1, slots) if s not in rows.tolist()]
    assert torch.equal(pool[0][untouched], before[untouched]) and torch.equal(pool[1][untouched], before[untouched])


@pytest.mark.parametrize("kernel", ["op", "reference"])
def test_ring_larger_than_the_window_reads_the_window(kernel):
    """A ring of W+K entries (speculative verify) still attends over exactly the last W positions: the
    same result as a ring of W entries holding the same keys."""
    from inkling_compiled.custom_ops import KERNELS

    attend_ring = {"op": torch.ops.inkling.ring_attention.default, **KERNELS["ring_attention"]}[kernel]
    g = torch.Generator().manual_seed(1)
    W, R, slots, n = 4, 7, 3, 20
    keys, values = torch.randn(n, 1, 4, generator=g), torch.randn(n, 1, 4, generator=g)
    positions = torch.tensor([2, 9, 17])
    q, table = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, W, generator=g)
    cache_indices = torch.tensor([1, 2, 1], dtype=torch.int32)
    outs = []
    for size in (W, R):
        rings = [torch.zeros(slots * size, 1, 4), torch.zeros(slots * size, 1, 4)]
        for row in range(3):
            slot, pos = cache_indices[row].item(), positions[row].item()
            for p in range(max(0, pos - size + 1), pos + 1):  # what a ring of `size` holds at `pos`
                rings[0][slot * size + p % size] = keys[p]
                rings[1][slot * size + p % size] = values[p]
            outs.append(attend_ring(q[row:row + 1], *rings, table[row:row + 1], positions[row:row + 1],
                                    cache_indices[row:row + 1], W, W, size))
    for row in range(3):
        assert torch.allclose(outs[row], outs[3 + row], atol=1e-6)


# ---- acceptance ---------------------------------------------------------------------------------------

def test_greedy_acceptance_is_the_longest_matching_prefix_plus_the_argmax():
    g = torch.Generator().manual_seed(2)
    B, K, V = 6, 3, 9
    logits = torch.randn(B, K + 1, V, generator=g)
    argmax = logits.argmax(-1)
    inputs = torch.randint(0, V, (B, K + 1), generator=g)
    for row in range(B):  # row r: its first min(r, K) drafts right, the next one wrong
        for i in range(K):
            inputs[row, i + 1] = argmax[row, i] if i < row else (argmax[row, i] + 1) % V
    zeros = torch.zeros(B)
    tokens, accepted, _ = verify_drafts(logits, inputs, torch.full((B,), K), zeros, torch.zeros(B, dtype=torch.long),
                                        torch.ones(B), torch.arange(B), torch.zeros(B, dtype=torch.long))
    assert accepted.tolist() == [min(r, K) for r in range(B)]
    for row in range(B):
        a = accepted[row].item()
        assert tokens[row, :a + 1].tolist() == argmax[row, :a + 1].tolist()


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.7)])
def test_rejection_sampling_keeps_the_target_distribution(top_k, top_p):
    """Over many seeds, the first emitted token follows the filtered target distribution p_0, and where the
    draft was accepted the next token follows p_1 (chi-square, 0.1% level), whatever the draft."""
    n, V = 6000, 5
    logits = torch.tensor([[1.5, 0.5, 0.0, -0.5, -1.0], [0.0, 1.0, 0.2, -0.3, 0.6], [0.3] * 5])
    temperature = 0.8
    inputs = torch.tensor([7 % V, 0, 1]).repeat(n, 1)  # draft 0 for position 0 (likely), 1 for position 1
    ones = torch.ones(n)
    tokens, accepted, _ = verify_drafts(logits.repeat(n, 1, 1), inputs, torch.full((n,), 2), ones * temperature,
                                        torch.full((n,), top_k), ones * top_p, torch.arange(n) * 7919,
                                        torch.full((n,), 5))

    def target(row):
        from inkling_compiled.custom_ops.sampling import filter_rows

        scaled = (logits[row] / temperature)[None]
        return torch.softmax(filter_rows(scaled, torch.tensor([top_k]), torch.tensor([top_p])), -1)[0]

    def chi_square_ok(samples, p):
        counts = torch.bincount(samples, minlength=V).float()
        keep = p > 0
        assert counts[~keep].sum() == 0, "a token outside the filtered support was emitted"
        expected = p[keep] * samples.numel()
        stat = ((counts[keep] - expected) ** 2 / expected).sum().item()
        return stat < 18.47  # chi-square 0.999 quantile, 4 degrees of freedom (fewer where filtered)

    assert chi_square_ok(tokens[:, 0], target(0))
    took_draft = accepted >= 1
    assert 0 < took_draft.sum() < n
    assert chi_square_ok(tokens[took_draft, 1], target(1))


def test_a_row_without_drafts_samples_as_plain_decoding_does(checkpoint):
    """Stand-ins fill a row whose drafter had nothing (or less than K): they are never accepted nor removed
    from the distribution, so a seeded request without drafts gets plain decoding's tokens even when it
    shares verify steps with requests that draft."""
    class OnlySecond(Drafter):
        def propose(self, reqs):
            return [None if r.prompt == [12] else [7, 8][:self.num_tokens] for r in reqs]

    params = [SamplingParams(max_new_tokens=16, temperature=1.0, top_k=2, seed=1, ignore_eos=True),
              SamplingParams(max_new_tokens=16, ignore_eos=True)]
    plain = engine_for(checkpoint, max_batch_size=2).generate([[12]], params[:1])[0]
    spec = engine_for(checkpoint, max_batch_size=2, speculative=OnlySecond(), num_speculative_tokens=2)
    outs = spec.generate([[12], [7, 8, 9] * 3 + [7, 8]], params)
    assert spec.stats()["verify_steps"] > 0 and outs[0].spec_proposed == 0
    assert outs[0].token_ids == plain.token_ids


def test_uniform_noise_stays_inside_the_open_interval():
    from inkling_compiled.sampling import unit_interval

    extremes = unit_interval(torch.tensor([0, 0xFFFFFFFF, 0x80000000]))
    assert (extremes > 0).all() and (extremes < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(extremes))).all()


def test_drafts_past_the_logits_are_cut_not_failed(checkpoint, plain_outputs):
    """Token ids in [unpadded vocab, vocab) are valid prompt tokens but never logits: prompt lookup may copy
    them into drafts, which then end there instead of failing the batch."""
    engine = engine_for(checkpoint, max_batch_size=2, max_model_len=640, speculative="ngram")
    top = engine.config.logits_vocab_size  # 264 on tiny; the embedding has 272 rows
    prompts = [[t for i in range(top) for t in (i, top + 1)], [11, 12, 13]]  # every token is followed by top+1
    checked, run = [], engine.worker.runner.run

    def run_checked(plan):  # the real drafts (the first `drafted`) that reach the verify step
        if plan.kind is StepKind.VERIFY:
            checked.extend(t for row, n in zip(plan.tokens, plan.drafted) for t in row[1:1 + n])
        return run(plan)

    engine.worker.runner.run = run_checked
    outs = engine.generate(prompts, GREEDY)
    want = engine_for(checkpoint, max_batch_size=2, max_model_len=640).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert engine.stats()["verify_steps"] > 0 and all(t < top for t in checked)


def test_same_seed_same_speculative_tokens_whatever_the_batch(checkpoint):
    engine = engine_for(checkpoint, max_batch_size=4, speculative="ngram", num_speculative_tokens=2)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    params = SamplingParams(max_new_tokens=12, temperature=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([prompt], params)[0].token_ids
    crowd = engine.generate([random_prompt(9, seed=1), prompt, random_prompt(4, seed=2)],
                            [SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True), params,
                             SamplingParams(max_new_tokens=5, ignore_eos=True)])
    assert crowd[1].token_ids == alone


# ---- drafters -----------------------------------------------------------------------------------------

def test_ngram_lookup_against_a_plain_loop():
    rng = np.random.default_rng(3)
    drafter = NgramDrafter(num_tokens=3, max_ngram=3, min_ngram=1)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=rng.integers(1, 14)).tolist()
        want = None
        for n in range(min(3, len(tokens) - 1), 0, -1):  # longest suffix first, its latest earlier match
            starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
            if starts:
                want = tokens[starts[-1] + n:starts[-1] + n + 3]
                break
        assert drafter.lookup(np.array(tokens)) == want, tokens


def test_speculative_options_are_checked(checkpoint):
    with pytest.raises(OptionError, match="speculative"):
        engine_for(checkpoint, speculative="eagle")
    with pytest.raises(OptionError, match="num_speculative_tokens"):
        engine_for(checkpoint, speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(OptionError, match="num_speculative_tokens"):
        engine_for(checkpoint, speculative="ngram", num_speculative_tokens=99)


# ---- the engine ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def copying(tmp_path_factory):
    """A tiny checkpoint whose layers all use a sliding window, and prompts whose continuation copies a
    span of the prompt (`bench.copy_prompts`): prompt lookup's best case, with transformers' outputs."""
    from inkling_compiled.bench import copy_prompts, sliding_only
    from inkling_compiled.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("sliding"), "tiny", overrides=sliding_only("tiny"))
    plain = Engine.from_pretrained(path, compile=False, max_batch_size=4, max_model_len=256, progress=False)
    prompts = copy_prompts(plain, [random_prompt(16, seed=120 + i) for i in range(3)], overlap=40,
                           new_tokens=GREEDY.max_new_tokens)
    hf = pytest.importorskip("transformers").InklingForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        want.append(ids[0, len(p):].tolist())
    return path, prompts, want


@pytest.mark.parametrize("K", [1, 2, 4])
def test_ngram_on_prompts_the_output_copies_accepts_nearly_everything(K, copying):
    path, prompts, want = copying
    engine = Engine.from_pretrained(path, compile=False, max_batch_size=4, max_model_len=256, progress=False,
                                    speculative="ngram", num_speculative_tokens=K)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    stats = engine.stats()
    assert stats["acceptance_rate"] > 0.8 and stats["mean_tokens_per_step"] > 1 + 0.6 * K

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], random_prompt(7, seed=11), random_prompt(19, seed=12),
           [40, 41, 40, 41, 40, 41, 40]]


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("name", ["tiny", "tiny-k3"])
def test_ngram_greedy_equals_plain_decoding_and_transformers(K, name, checkpoint, plain_outputs, hf_greedy):
    engine = engine_for(checkpoint, name, max_batch_size=4, max_model_len=128, speculative="ngram",
                        num_speculative_tokens=K)
    outs = engine.generate(PROMPTS, GREEDY)
    for prompt, out, plain in zip(PROMPTS, outs, plain_outputs(name, PROMPTS)):
        assert out.token_ids == plain.token_ids
        assert max(abs(a - b) for a, b in zip(out.logprobs, plain.logprobs)) < 1e-4
        assert out.token_ids == hf_greedy(name, prompt, GREEDY.max_new_tokens)[0]
    stats = engine.stats()
    assert stats["verify_steps"] > 0 and stats["spec_proposed"] == sum(o.spec_proposed for o in outs) > 0


@pytest.mark.parametrize("K", [1, 2, 4])
def test_rows_accepting_different_counts_stay_exact(K, checkpoint, plain_outputs, hf_greedy):
    """A drafter that knows the answer but misses at a different index in each row and step: acceptance
    covers every count 0..K in one batch, and the state the commits leave keeps decoding exact."""
    prompts = [random_prompt(5 + 3 * i, seed=20 + i) for i in range(4)]
    want = plain_outputs("tiny", prompts)
    drafter = ScriptedDrafter({tuple(p): o.token_ids for p, o in zip(prompts, want)},
                              miss=lambda row, step: (row + step) % (K + 1))
    engine = engine_for(checkpoint, max_batch_size=4, max_model_len=128, speculative=drafter, num_speculative_tokens=K)
    outs = engine.generate(prompts, GREEDY)
    for prompt, out, plain in zip(prompts, outs, want):
        assert out.token_ids == plain.token_ids == hf_greedy("tiny", prompt, GREEDY.max_new_tokens)[0]
        assert out.spec_accepted > 0 and out.spec_accepted < out.spec_proposed
    stats = engine.stats()
    assert stats["mean_tokens_per_step"] > 1.0


def test_acceptance_by_depth_counts_each_draft_position(checkpoint, plain_outputs):
    """Drafts right at depth 1, wrong at depth 2, right at depth 3: depth 1 is always accepted, depths 2 and
    3 never (a draft counts only with every draft before it)."""
    prompts = [random_prompt(6 + i, seed=40 + i) for i in range(3)]
    params = SamplingParams(max_new_tokens=7, ignore_eos=True)  # a row's last steps draft fewer than K
    want = plain_outputs("tiny", prompts, params)
    drafter = ScriptedDrafter({tuple(p): o.token_ids for p, o in zip(prompts, want)}, miss=lambda row, step: 1)
    engine = engine_for(checkpoint, max_batch_size=4, max_model_len=128, speculative=drafter, num_speculative_tokens=3)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    stats = engine.stats()
    assert stats["acceptance_by_depth"] == [1.0, 0.0, 0.0]
    assert stats["acceptance_rate"] == pytest.approx(stats["spec_accepted"] / stats["spec_proposed"])
    assert stats["spec_accepted"] == engine.scheduler.depth_proposed[0]  # each accepted draft was a depth-1 one


def test_stops_and_length_inside_an_accepted_run(checkpoint, plain_outputs):
    """All drafts right: a stop token or max_new_tokens in the middle of an accepted run ends the request
    there, never past it."""
    prompts = [random_prompt(6 + i, seed=30 + i) for i in range(3)]
    long = plain_outputs("tiny", prompts)
    drafter = ScriptedDrafter({tuple(p): o.token_ids for p, o in zip(prompts, long)}, miss=lambda row, step: 99)
    engine = engine_for(checkpoint, max_batch_size=4, max_model_len=128, speculative=drafter, num_speculative_tokens=4)
    stop = long[0].token_ids[6]
    params = [SamplingParams(max_new_tokens=14, stop_token_ids=(stop,), ignore_eos=True),
              SamplingParams(max_new_tokens=7, ignore_eos=True), SamplingParams(max_new_tokens=3, ignore_eos=True)]
    outs = engine.generate(prompts, params)
    first_stop = long[0].token_ids.index(stop)
    assert outs[0].token_ids == long[0].token_ids[:first_stop + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == long[1].token_ids[:7] and outs[1].finish_reason == "length"
    assert outs[2].token_ids == long[2].token_ids[:3]
    assert outs[2].spec_accepted == 2  # every draft was right, but only two fit before the length
    assert all(o.spec_accepted <= len(o.token_ids) - 1 for o in outs)  # counted: accepted and emitted
    assert engine.worker.pool.slots.num_free == engine.worker.pool.slots.capacity


def test_continuous_batching_staggered_arrivals_and_aborts(checkpoint, plain_outputs):
    prompts = [random_prompt(4 + 3 * i, seed=40 + i) for i in range(8)]
    want = plain_outputs("tiny", prompts)
    drafter = ScriptedDrafter({tuple(p): o.token_ids for p, o in zip(prompts, want)}, miss=lambda row, step: step % 3)
    engine = engine_for(checkpoint, max_batch_size=3, max_model_len=128, speculative=drafter, num_speculative_tokens=2)
    final, rids, victim = {}, {}, None
    for step in range(200):
        if step < 8:
            rids[engine.add_request(prompts[step], GREEDY)] = step
            victim = victim or (next(iter(rids)) if step == 2 else None)
        if step == 4:
            engine.abort(victim)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if len(final) == 8 and not engine.has_unfinished():
            break
    assert final[victim].finish_reason == "abort"
    for rid, i in rids.items():
        if rid != victim:
            assert final[rid].token_ids == want[i].token_ids
    assert engine.worker.pool.slots.num_free == engine.worker.pool.slots.capacity


def test_the_verify_step_commits_its_own_rows_slots(checkpoint):
    """The verify step commits inside itself, on its own rows' slots: each verify row's slot takes the
    window saved after its last accepted token (read from the saved windows, which the commit does not
    write), and every other slot stays as it was, also once the step buffers are refilled for another
    batch (as the next step's prep does; the commit SGLang made after the step read them from there)."""
    engine = engine_for(checkpoint, max_batch_size=4, max_model_len=64, speculative="ngram", num_speculative_tokens=2)
    for i in range(4):
        engine.add_request(random_prompt(5 + i, seed=50 + i), SamplingParams(max_new_tokens=20, ignore_eos=True))
    engine.step()  # prefill: all four decode from the next step on
    reqs = list(engine.scheduler.running)
    runner, pool = engine.worker.runner, engine.worker.pool
    verify_rows, others = reqs[:2], reqs[2:]
    (plan,) = engine.scheduler.decode_plans(verify_rows, [[3, 4], [5, 6]])
    runner.prepare(plan)
    before = {name: torch.stack(layers) for name, layers in pool.conv.items()}  # [L, slots, K-1, D] copies
    with torch.inference_mode():
        from inkling_compiled.runner import verify_step
        out = verify_step(engine.model, engine.worker.backend)
    engine.worker.backend.prepare_decode([r.output[-1] for r in others], [pool.slot_of[r.request_id] for r in others],
                                         [r.cached_len for r in others], [r.sampling_row() for r in others])
    accepted = out[1].tolist()
    for name, layers in pool.conv.items():
        t, windows = torch.stack(layers), torch.stack(pool.intermediate_conv_window[name])
        for row, slot in enumerate(plan.slots):
            assert torch.equal(t[:, slot], windows[:, row, accepted[row]])
            assert not torch.equal(t[:, slot], before[name][:, slot])
        for req in others:
            slot = pool.slot_of[req.request_id]
            assert torch.equal(t[:, slot], before[name][:, slot])
    assert out[0].shape == (2, 3)


def test_every_layer_and_stream_commits(checkpoint):
    """After one verify step whose rows accept 0, 1 and 2 drafts, every (layer, stream) window of each row's
    slot equals the one plain decoding leaves after the same tokens. (The verify forward runs its
    projections over more rows than decode, so the activations, and with them the windows, may differ in
    the last bits; the op-level test above checks the commit itself bit for bit.)"""
    prompts = [random_prompt(6 + i, seed=60 + i) for i in range(3)]
    plain = engine_for(checkpoint, max_batch_size=3, max_model_len=64)
    want = plain.generate(prompts, GREEDY)
    snapshots = []  # after s plain decode steps: request index -> {pool stream: windows of its slot}
    for p in prompts:
        plain.add_request(p, GREEDY)
    for _ in range(4):
        plain.step()
        slots = {prompts.index(r.prompt): plain.worker.pool.slot_of[r.request_id] for r in plain.scheduler.running}
        snapshots.append({i: {name: torch.stack([t[slot] for t in layers]) for name, layers in plain.worker.pool.conv.items()}
                          for i, slot in slots.items()})
    drafter = ScriptedDrafter({tuple(p): o.token_ids for p, o in zip(prompts, want)}, miss=lambda row, step: row)
    spec = engine_for(checkpoint, max_batch_size=3, max_model_len=64, speculative=drafter, num_speculative_tokens=2)
    for p in prompts:
        spec.add_request(p, GREEDY)
    spec.step()  # prefill
    spec.step()  # one verify: rows emit 1, 2 and 3 tokens
    for row, req in enumerate(spec.scheduler.running):
        i = prompts.index(req.prompt)
        assert len(req.output) == 2 + row and req.output == want[i].token_ids[:2 + row]
        slot = spec.worker.pool.slot_of[req.request_id]
        for layer in range(spec.config.num_hidden_layers):
            for stream in MODEL_STREAMS:
                name, index = spec.worker.pool.layer_index(layer, stream)
                got, expected = spec.worker.pool.conv[name][index][slot], snapshots[row + 1][i][name][index]
                assert torch.allclose(got, expected, atol=1e-5), (layer, stream, row)


# ---- compiled -----------------------------------------------------------------------------------------

@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_one_symbolic_verify_graph_no_breaks_and_a_full_census(checkpoint, fresh_dynamo):
    """K=3: one verify graph with a symbolic batch serves both buckets, with every (layer, stream) conv
    as sconv_verify (none decodes), one kv_write per layer, zero graph breaks; replays (of 3 rows and of
    1, padded) never recompile."""
    from inkling_compiled.graphs import GraphRecorder, census
    from inkling_compiled.streams import STREAM_NAMES

    torch._dynamo.utils.counters.clear()
    recorder = GraphRecorder("eager")
    engine = engine_for(checkpoint, compile=True, max_batch_size=4, buckets=(2, 4), compile_backend=recorder,
                        speculative=Threes(), num_speculative_tokens=3)
    assert engine.worker.decoder.graphs() == [(2, 4)] and engine.worker.verifier.graphs() == [(2, 4)]
    assert not torch._dynamo.utils.counters["graph_break"]
    layers = engine.config.num_hidden_layers
    verify_graphs = [gm for gm in recorder.graphs if "inkling::sconv_verify" in census(gm)["ops"]]
    assert len(verify_graphs) == 1 and has_symbolic_batch(verify_graphs[0])
    for gm in verify_graphs:
        c = census(gm)
        calls = sorted((x["layer"], x["stream"]) for x in c["custom_calls"] if x["op"] == "inkling::sconv_verify")
        assert calls == sorted((layer, s) for layer in range(layers) for s in STREAM_NAMES)
        assert c["sconv_calls"] == 4 * layers and "inkling::sconv_decode" not in c["ops"]
        assert c["ops"]["inkling::kv_write"] == layers
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    outs = engine.generate([[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9], [4, 5, 4, 5, 4]],
                           SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    assert engine.stats()["verify_steps"] >= 5 and engine.stats()["decode_steps"] == 0
    assert all(len(o.token_ids) == 6 for o in outs)
    engine.generate([[4, 5]], SamplingParams(max_new_tokens=3, ignore_eos=True))  # one row, in bucket 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


def test_verify_with_batch_one_specialised(checkpoint, fresh_dynamo):
    """specialize_batch_one: bucket 1 verifies on a static graph of its own, the others on one symbolic
    graph whose token dimension is a multiple of its rows (Dynamo learns it from the step's checks)."""
    from inkling_compiled.graphs import GraphRecorder, census

    recorder = GraphRecorder("eager")
    engine = engine_for(checkpoint, compile=True, max_batch_size=4, buckets=(1, 2, 4), compile_backend=recorder,
                        speculative="ngram", num_speculative_tokens=2, specialize_batch_one=True)
    assert engine.worker.verifier.graphs() == [(1,), (2, 4)]
    verify_graphs = [gm for gm in recorder.graphs if "inkling::sconv_verify" in census(gm)["ops"]]
    assert [has_symbolic_batch(gm) for gm in verify_graphs] == [False, True]


def test_compiled_verify_equals_eager_plain_decoding_across_a_split_batch(checkpoint, plain_outputs, fresh_dynamo):
    """Inductor verify graphs for buckets (1, 4); six rows verify as 4 + 2, each chunk committed before the
    next overwrites the saved windows; rows accept different counts. Tokens equal plain eager decoding."""
    prompts = [random_prompt(4 + 2 * i, seed=100 + i) for i in range(6)]
    want = plain_outputs("tiny", prompts)
    drafter = ScriptedDrafter({tuple(p): o.token_ids for p, o in zip(prompts, want)},
                              miss=lambda row, step: (row + step) % 3)
    engine = engine_for(checkpoint, compile=True, max_batch_size=6, buckets=(1, 4), max_model_len=128,
                        speculative=drafter, num_speculative_tokens=2)
    outs = engine.generate(prompts, GREEDY)
    for out, w in zip(outs, want):
        assert out.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(out.logprobs, w.logprobs)) < 1e-4
    assert engine.stats()["mean_tokens_per_step"] > 1.5


def test_a_failing_drafter_fails_its_batch_and_the_engine_serves_on(checkpoint, plain_outputs):
    class Flaky(Drafter):
        def __init__(self, failure):
            self.calls, self.failure = 0, failure

        def propose(self, reqs):
            self.calls += 1
            if self.calls == 2:
                return self.failure(reqs)
            return [None for _ in reqs]

    def explode(reqs):
        raise RuntimeError("drafter exploded")

    prompt = random_prompt(6, seed=7)
    for failure, needle in ((explode, "drafter exploded"), (lambda reqs: [[10**6]] * len(reqs), "outside the vocabulary")):
        engine = engine_for(checkpoint, max_batch_size=2, max_model_len=64, speculative=Flaky(failure))
        outs = engine.generate([[5, 6, 7], [8, 9]], GREEDY)
        assert all(o.finish_reason == "error" and needle in o.error for o in outs)
        assert engine.generate([prompt], GREEDY)[0].token_ids == plain_outputs("tiny", [prompt])[0].token_ids
        assert engine.worker.pool.slots.num_free == engine.worker.pool.slots.capacity


def test_k_larger_than_the_prefill_chunk_and_the_batch(checkpoint, plain_outputs):
    """The verify buffers are sized for K+1 tokens per row even when a prefill chunk and the batch are both
    smaller than that."""
    prompt = random_prompt(7, seed=9)
    engine = engine_for(checkpoint, max_batch_size=1, prefill_chunk_tokens=2, speculative="ngram",
                        num_speculative_tokens=4)
    engine.drafter.lookup = lambda tokens: [3, 4, 5, 6]  # always a draft: every step verifies
    out = engine.generate([prompt], GREEDY)[0]
    assert out.token_ids == plain_outputs("tiny", [prompt])[0].token_ids and engine.stats()["verify_steps"] > 0


def test_padding_rows_stay_in_bounds_when_k_outgrows_a_page(checkpoint):
    """K+1 verify positions longer than a request's whole page table: padded rows (what warm-up runs) still
    write only the dummy page's first row, and a real row's positions past its pages go to the dummy."""
    engine = engine_for(checkpoint, max_batch_size=2, max_model_len=16, page_size=16, speculative="ngram",
                        num_speculative_tokens=16)
    md = engine.worker.backend.buffers.prepare_verify_padding(2)
    assert md.global_kv_loc.tolist() == [0] * 34 and (md.sliding_kv_loc[1:17] == -1).all()
    out = engine.generate([[5, 6, 5, 6, 5]], SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 10


def test_a_refused_commit_changes_nothing():
    """The C++ commit checks every stream and row before it copies anything."""
    states = [torch.zeros(4, 2, 3), torch.zeros(4, 2, 3), torch.zeros(4, 2, 5)]
    windows = [torch.ones(2, 3, 2, 3), torch.ones(2, 3, 2, 3), torch.ones(2, 2, 2, 5)]  # the last saved 2 steps, not 3
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.inkling.commit_conv_windows(states, windows, torch.tensor([1, 2], dtype=torch.int32),
                                              torch.tensor([0, 2]))
    assert all((s == 0).all() for s in states)


def test_recompile_limits_leave_room_for_every_verify_graph_in_the_process(checkpoint):
    """Every speculative engine adds a static verify graph per bucket to the one cache of VerifyStep.forward,
    and entries of engines gone stay in it: the limits grow with each engine made (else the n-th engine's
    warm-up fails on Dynamo's recompile limit)."""
    engines = [engine_for(checkpoint, compile=True, warmup=False, max_batch_size=4, buckets=(1, 2, 4),
                          compile_backend="eager", speculative="ngram") for _ in range(12)]
    graphs = sum(len(e.worker.verifier.buckets) + len(e.worker.decoder.buckets) for e in engines)
    assert torch._dynamo.config.recompile_limit > graphs

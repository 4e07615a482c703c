"""The prefix cache: full prompt pages shared across requests, resumed from the conv windows and sliding
rings checkpointed at their boundaries. Outputs are held to transformers (batch 1); `cached_tokens` to
the exact boundary a hit must take; pool accounting to zero leaks."""

import random

import pytest
import torch

from inkling_compiled.engine import Engine
from inkling_compiled.sampling import SamplingParams

from conftest import PARITY_CONFIGS, random_prompt

NEW = 5
PARAMS = SamplingParams(max_new_tokens=NEW, logprobs=True, ignore_eos=True)
PAGE = 8


def engine_for(checkpoint, name, **kw):
    kw = {"compile": False, "max_batch_size": 4, "page_size": PAGE, "prefill_chunk_tokens": 32, "progress": False,
          **kw}
    return Engine.from_pretrained(checkpoint(name), **kw)


def assert_matches(hf_greedy, name, prompt, out):
    want_tokens, want_logprobs = hf_greedy(name, prompt, NEW)
    assert out.token_ids == want_tokens
    assert max(abs(a - b) for a, b in zip(out.logprobs, want_logprobs.tolist())) < 1e-4


def longest_boundary(prompt_len: int, shared: int) -> int:
    """The deepest page boundary inside the shared prefix that leaves a prompt token to prefill."""
    return min(shared, prompt_len - 1) // PAGE * PAGE


def assert_no_leaks(engine):
    """Every slot and checkpoint free; every page free or held by exactly the cache entries that own it."""
    pool, cache = engine.worker.pool, engine.cache.prefix
    assert not engine.has_unfinished()
    assert pool.slots.num_free == pool.slots.capacity and not pool.slot_of and not pool.pages_of
    entries = cache.entries() if cache else []
    assert all(e.users == 0 for e in entries)
    owned = [e.page for e in entries if e.page is not None]
    assert sorted(p for p, refs in enumerate(pool.page_refs) if refs) == sorted(owned)
    assert all(pool.page_refs[p] == 1 for p in owned)
    assert pool.pages.num_free == pool.pages.capacity - len(owned)
    assert pool.checkpoints.num_free == pool.checkpoints.capacity - sum(e.checkpoint is not None for e in entries)


@pytest.mark.parametrize("name", PARITY_CONFIGS)
def test_a_second_wave_resumes_from_the_shared_system_prompt(name, checkpoint, hf_greedy):
    """16 requests share a 45-token system prompt, in two waves of 8. The second wave resumes from the
    deepest page boundary inside it (40), and every output equals transformers'."""
    engine = engine_for(checkpoint, name, max_batch_size=8, prefix_checkpoints=64)
    system = random_prompt(45, seed=1)
    prompts = [system + random_prompt(3 + i, seed=100 + i) for i in range(16)]
    first = engine.generate(prompts[:8], PARAMS)
    second = engine.generate(prompts[8:], PARAMS)
    assert all(o.cached_tokens == longest_boundary(len(p), 45) for p, o in zip(prompts[8:], second))
    assert first[0].cached_tokens == 0
    for prompt, out in zip(prompts, first + second):
        assert_matches(hf_greedy, name, prompt, out)
    assert_no_leaks(engine)


def test_edges_of_a_prefix(checkpoint, hf_greedy):
    """A prompt diverging inside a page resumes from the page before; a prompt that is all cached prefix
    resumes one page short of its end (its last token must be prefilled for its logits); prompts shorter
    than a page, or than the conv kernel, hit nothing."""
    engine = engine_for(checkpoint, "tiny")
    base = random_prompt(40, seed=7)
    (seed_out,) = engine.generate([base], PARAMS)
    cases = [
        (base[:21] + random_prompt(9, seed=8), 16),  # diverges at 21, inside page 3
        (base[:32], 24),  # entirely cached (4 full pages): the 4th must be prefilled again
        (base[:33], 32),
        (base[:2], 0),  # shorter than the conv kernel
        (base[:8], 0),  # exactly one page: nothing left to prefill past it
    ]
    for prompt, cached in cases:
        (out,) = engine.generate([prompt], PARAMS)
        assert out.cached_tokens == cached, prompt
        assert_matches(hf_greedy, "tiny", prompt, out)
    assert seed_out.cached_tokens == 0
    assert_no_leaks(engine)


def test_checkpoints_a_token_or_two_past_a_chunk_start(checkpoint, hf_greedy):
    """Chunks of 7 put page boundaries 1, 2, 3 ... tokens past a chunk's start, where a conv checkpoint
    takes most of its window from the row's state before the chunk, and two prompts prefilled together
    put another sequence's tokens just before the chunk in the packed step. Resuming from each boundary
    matches transformers."""
    engine = engine_for(checkpoint, "tiny", prefill_chunk_tokens=7, prefix_checkpoints=64)
    bases = [random_prompt(40, seed=30), random_prompt(40, seed=31)]
    engine.generate(bases, PARAMS)
    prompts = [base[:cut] + random_prompt(4, seed=40 + cut) for base in bases for cut in (9, 17, 25)]
    for prompt, out in zip(prompts, engine.generate(prompts, PARAMS)):
        assert out.cached_tokens == (len(prompt) - 4) // PAGE * PAGE
        assert_matches(hf_greedy, "tiny", prompt, out)
    assert_no_leaks(engine)


def test_a_hit_then_abort_then_reuse(checkpoint, hf_greedy):
    engine = engine_for(checkpoint, "tiny")
    base = random_prompt(30, seed=9)
    engine.generate([base], PARAMS)
    rid = engine.add_request(base[:26] + [5, 6, 7], PARAMS)
    engine.step()
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    prompt = base[:27] + [9]
    (out,) = engine.generate([prompt], PARAMS)
    assert out.cached_tokens == 24
    assert_matches(hf_greedy, "tiny", prompt, out)
    assert_no_leaks(engine)


def test_eviction_under_a_small_budget_keeps_hits_correct(checkpoint, hf_greedy):
    """A pool with pages for about two requests and 6 checkpoints: cached prefixes are evicted (least
    recently used first) to admit new requests, and hits before and after eviction stay exact."""
    engine = engine_for(checkpoint, "tiny", max_batch_size=2, num_pages=16, max_model_len=64,
                        prefix_checkpoints=6)
    a, b = random_prompt(33, seed=11), random_prompt(33, seed=12)
    (out_a,) = engine.generate([a], PARAMS)
    (hit_a,) = engine.generate([a[:30] + [3]], PARAMS)
    assert hit_a.cached_tokens == 24
    engine.generate([b], PARAMS)
    engine.generate([random_prompt(50, seed=13)], PARAMS)  # needs pages: evicts
    (again,) = engine.generate([b[:30] + [4]], PARAMS)
    for prompt, out in [(a, out_a), (a[:30] + [3], hit_a), (b[:30] + [4], again)]:
        assert_matches(hf_greedy, "tiny", prompt, out)
    assert again.cached_tokens in (0, 8, 16, 24)
    assert_no_leaks(engine)


def test_no_prefix_cache_means_no_hits(checkpoint, hf_greedy):
    engine = engine_for(checkpoint, "tiny", prefix_cache=False)
    base = random_prompt(30, seed=9)
    outs = engine.generate([base, base + [3]], PARAMS) + engine.generate([base + [4]], PARAMS)
    assert [o.cached_tokens for o in outs] == [0, 0, 0]
    assert engine.cache.prefix is None and engine.worker.pool.checkpoints.capacity == 0


@pytest.mark.parametrize("host_cache_bytes", [0, 20_000])  # off, and a host tier small enough to trim
def test_random_schedules_leak_nothing(host_cache_bytes, checkpoint):
    """Arrivals sharing prefixes, aborts at random points (prefilling or decoding), small pools that
    force eviction: afterwards no slot, page or checkpoint is held but by the cache, and nothing is
    pinned. Every served request equals its solo run on an engine without the cache."""
    rng = random.Random(0)
    engine = engine_for(checkpoint, "tiny", max_batch_size=3, num_pages=24, max_model_len=64, prefill_chunk_tokens=11,
                        prefix_checkpoints=5, host_cache_bytes=host_cache_bytes)
    solo = engine_for(checkpoint, "tiny", max_batch_size=1, prefix_cache=False, max_model_len=64)
    roots = [random_prompt(24, seed=20 + i) for i in range(3)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    live, served = {}, {}
    for step in range(120):
        if step < 80 and rng.random() < 0.4:
            prompt = rng.choice(roots)[:rng.randint(1, 24)] + random_prompt(rng.randint(0, 9), seed=step)
            live[engine.add_request(prompt, params)] = prompt
        if live and rng.random() < 0.08:
            rid = rng.choice(sorted(live))
            engine.abort(rid)
            live.pop(rid)
        for out in engine.step():
            if out.finished and out.finish_reason != "abort":
                served[out.request_id] = (live.pop(out.request_id), out.token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.finish_reason != "abort":
                served[out.request_id] = (live.pop(out.request_id), out.token_ids)
    assert len(served) > 20 and engine.cache.hits > 5
    for prompt, tokens in served.values():
        assert solo.generate([prompt], params)[0].token_ids == tokens
    assert_no_leaks(engine)
    assert 0 <= engine.cache.prefix.host_used <= host_cache_bytes
    assert (engine.cache.host_hits > 0) == (host_cache_bytes > 0)  # the tier was really used
    assert engine.clear_prefix_cache() > 0  # and the cache itself empties completely
    assert engine.cache.prefix.host_used == 0 and not engine.cache.prefix.entries()
    assert engine.worker.pool.pages.num_free == engine.worker.pool.pages.capacity
    assert engine.worker.pool.checkpoints.num_free == engine.worker.pool.checkpoints.capacity


def test_compiled_engine_with_hits(checkpoint, hf_greedy):
    # the default page size (not this module's PAGE): the steps saved by earlier tests load, not compile
    engine = engine_for(checkpoint, "tiny", compile=True, buckets=(1, 4), page_size=16)
    system = random_prompt(20, seed=30)
    prompts = [system + random_prompt(4, seed=31 + i) for i in range(4)]
    outs = engine.generate(prompts[:1], PARAMS) + engine.generate(prompts[1:], PARAMS)
    assert [o.cached_tokens for o in outs] == [0, 16, 16, 16]
    for prompt, out in zip(prompts, outs):
        assert_matches(hf_greedy, "tiny", prompt, out)
    torch._dynamo.reset()


def test_scarce_checkpoints_go_to_the_deepest_boundaries(checkpoint):
    """With 4 checkpoints and one 256-token chunk crossing 13 boundaries, the deepest are kept: later
    requests sharing the 200-token prefix resume at 192, not at the first boundaries of the chunk."""
    engine = engine_for(checkpoint, "tiny", max_batch_size=1, page_size=16, prefill_chunk_tokens=256,
                        prefix_checkpoints=4)
    system = random_prompt(200, seed=40)
    outs = [engine.generate([system + random_prompt(9, seed=41 + i)], PARAMS)[0] for i in range(3)]
    assert [o.cached_tokens for o in outs] == [0, 192, 192]


def test_a_request_that_cannot_fit_does_not_wipe_the_cache(checkpoint):
    """Eviction that could not admit the request anyway (the pages it would free are too few) evicts
    nothing: the cached system prompt survives the wait."""
    engine = engine_for(checkpoint, "tiny", max_model_len=64, num_pages=21, prefill_chunk_tokens=64)
    long = SamplingParams(max_new_tokens=46, ignore_eos=True)
    for seed in (1, 2):
        engine.add_request(random_prompt(10, seed=seed), long)  # 56 tokens: 7 pages each, decoding a while
    engine.step()
    system = random_prompt(40, seed=3)
    engine.generate([system + [1]], SamplingParams(max_new_tokens=2))  # 5 of its pages stay cached
    cached = len(engine.cache.prefix.entries())
    waiting = engine.add_request(random_prompt(10, seed=4), SamplingParams(max_new_tokens=54, ignore_eos=True))
    engine.step()  # needs 8 pages: 1 free + 5 evictable is not enough
    assert any(r.request_id == waiting for r in engine.scheduler.waiting) and len(engine.cache.prefix.entries()) == cached
    while engine.has_unfinished():
        engine.step()
    (out,) = engine.generate([system + [2]], SamplingParams(max_new_tokens=1))
    assert out.cached_tokens == 40


@pytest.mark.parametrize("kwargs, needle", [
    (dict(prefix_checkpoints=0), "prefix_checkpoints must be an integer >= 1, got 0"),
    (dict(prefix_checkpoints=-1, prefix_cache=False), "prefix_checkpoints must be an integer >= 1, got -1"),
    (dict(prefix_cache="yes"), "prefix_cache must be True or False"),
    (dict(max_prefill_tokens=64), "max_prefill_tokens was replaced by prefill_chunk_tokens"),
])
def test_prefix_options_are_checked(kwargs, needle, checkpoint):
    from inkling_compiled.errors import OptionError

    with pytest.raises(OptionError, match=needle):
        engine_for(checkpoint, "tiny", **kwargs)


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_one_state_budget_is_split_and_reported(speculative, checkpoint):
    """state_memory_bytes: the slots first, then checkpoints (4 per slot, at most a quarter of what is
    left), then KV pages; the memory report counts the tensors the pool really holds. With speculative
    decoding a slot costs its longer rings and its row of draft windows too."""
    from inkling_compiled.errors import OptionError

    engine = engine_for(checkpoint, "tiny", state_memory_bytes=2**20, speculative=speculative)
    report, costs = engine.memory_report(), engine.worker.unit_costs
    slots = report["slot conv windows"] + report["slot sliding rings"] + report["draft windows"]
    assert (report["draft windows"] > 0) == (speculative is not None)
    assert slots == (report["slots"] + 1) * costs.slot
    assert report["prefix checkpoints"] == (report["checkpoints"] + 1) * costs.checkpoint
    assert report["KV pages"] == (report["pages"] + 1) * costs.page
    assert report["checkpoints"] == min(4 * 4, (2**20 - 5 * costs.slot) // 4 // costs.checkpoint - 1)
    held = sum(report[k] for k in ("slot conv windows", "slot sliding rings", "draft windows", "KV pages",
                                   "prefix checkpoints"))
    assert 2**20 - costs.page < held <= 2**20  # the whole budget, to a page
    (out,) = engine.generate([random_prompt(30, seed=1)], PARAMS)
    assert out.finish_reason == "length"
    with pytest.raises(OptionError, match=r"state_memory_bytes=1000 holds too little: 4 slots \("):
        engine_for(checkpoint, "tiny", state_memory_bytes=1000)
    with pytest.raises(OptionError, match="give num_pages or state_memory_bytes, not both"):
        engine_for(checkpoint, "tiny", state_memory_bytes=2**20, num_pages=9)
    assert "KV pages of 8 tokens" in engine.memory_summary()


def test_the_host_tier_keeps_evicted_prefixes_and_loads_them_back(checkpoint, hf_greedy):
    """A pool too small for two cached prompts evicts the first to host memory (not dropped); a request
    sharing it later resumes from it (loaded back layer by layer) with transformers' outputs."""
    engine = engine_for(checkpoint, "tiny", max_batch_size=2, num_pages=13, max_model_len=64,
                        prefix_checkpoints=3, host_cache_bytes=2**20)
    a, b = random_prompt(33, seed=50), random_prompt(33, seed=51)
    engine.generate([a], PARAMS)
    engine.generate([b], PARAMS)  # needs a's pages: a's entries go to the host tier
    assert any(e.host is not None for e in engine.cache.prefix.entries()) and engine.cache.prefix.host_used > 0
    prompts = [a[:30] + [3], a[:29] + [4, 5]]  # both resume from it; the second waits for the first's load
    outs = engine.generate(prompts, PARAMS)
    assert [o.cached_tokens for o in outs] == [24, 24]
    for prompt, out in zip(prompts, outs):
        assert_matches(hf_greedy, "tiny", prompt, out)
    assert_no_leaks(engine)
    engine.clear_prefix_cache()
    assert engine.cache.prefix.host_used == 0 and not engine.cache.prefix.entries()


def test_a_host_load_that_lands_late_is_never_read_early(checkpoint, hf_greedy, monkeypatch):
    """The load back from host memory is slowed down and everything it will write is NaN until it lands,
    layer by layer: the prefill still gives transformers' outputs, so no layer was read early, and it
    did have to wait."""
    import time

    from inkling_compiled.cache.host_tier import HostLoad

    engine = engine_for(checkpoint, "tiny", max_batch_size=1, num_pages=9, max_model_len=64,
                        prefix_checkpoints=3, host_cache_bytes=2**20)
    a, b = random_prompt(33, seed=60), random_prompt(33, seed=61)
    engine.generate([a], PARAMS)
    engine.generate([b], PARAMS)
    copy_layer, wait_until, blocked = HostLoad.copy_layer, HostLoad.wait_until, []

    def late(self, layer):
        if layer == 0:  # poison every destination first: a read before its layer lands sees NaN
            pool, ps, W = self.pool, self.pool.page_size, self.pool.config.sliding_window_size
            for _, page in self.pages:
                for t in (t for layers in pool.global_kv for t in layers):
                    t[page * ps:(page + 1) * ps] = float("nan")
            for t in (t for layers in pool.conv.values() for t in layers):
                t[self.slot] = float("nan")
            for t in (t for layers in pool.sliding_kv for t in layers):
                t[self.slot * W:(self.slot + 1) * W] = float("nan")
        time.sleep(0.01)
        copy_layer(self, layer)

    def waiting(self, layer_id):
        blocked.append(not self.done[layer_id].is_set())
        wait_until(self, layer_id)

    monkeypatch.setattr(HostLoad, "copy_layer", late)
    monkeypatch.setattr(HostLoad, "wait_until", waiting)
    prompt = a[:30] + [3]
    (out,) = engine.generate([prompt], PARAMS)
    assert out.cached_tokens == 24 and any(blocked)
    assert_matches(hf_greedy, "tiny", prompt, out)


def assert_cleared(engine):
    engine.clear_prefix_cache()
    pool = engine.worker.pool
    assert pool.pages.num_free == pool.pages.capacity and pool.checkpoints.num_free == pool.checkpoints.capacity
    assert engine.cache.prefix.host_used == 0 and not engine.cache.prefix.entries()


def test_resuming_through_host_pages_without_checkpoints_leaks_nothing(checkpoint, hf_greedy):
    """One checkpoint for the whole cache: pages pushed to the host tier come back as plain pages (no
    checkpoint of their own) under a request that resumes below them; none is counted twice."""
    engine = engine_for(checkpoint, "tiny", max_batch_size=2, num_pages=7, max_model_len=64, prefix_checkpoints=1,
                        host_cache_bytes=2**20)
    a, b = random_prompt(33, seed=50), random_prompt(33, seed=51)
    engine.generate([a], PARAMS)
    engine.generate([b], PARAMS)
    prompt = a[:32] + [3]
    (out,) = engine.generate([prompt], PARAMS)
    assert out.cached_tokens == 32 and engine.cache.host_hits == 1
    assert_matches(hf_greedy, "tiny", prompt, out)
    assert_no_leaks(engine)
    assert_cleared(engine)


def test_an_entry_too_big_for_the_host_tier_takes_its_host_children_along(checkpoint):
    """A tier that holds a page but not a page and a checkpoint: the entry that does not fit is dropped
    with the host entries below it, and their bytes leave the tier's count."""
    engine = engine_for(checkpoint, "tiny", max_batch_size=1, num_pages=9, max_model_len=64, prefix_checkpoints=1,
                        host_cache_bytes=5000)
    a = random_prompt(25, seed=70)
    for prompt in (a, a[:24] + random_prompt(17, seed=71), random_prompt(33, seed=72)):
        engine.generate([prompt], PARAMS)
        assert engine.cache.prefix.host_used == sum(e.host.nbytes for e in engine.cache.prefix.entries() if e.host)
    assert_cleared(engine)


def fail_the_first_host_copy(monkeypatch) -> list[int]:
    """The host tier's next copy back raises at layer 1 (once); the list records that it did."""
    from inkling_compiled.cache.host_tier import HostLoad

    copy_layer, failures = HostLoad.copy_layer, []

    def failing_once(self, layer):
        if layer == 1 and not failures:
            failures.append(layer)
            raise OSError("injected host copy failure")
        copy_layer(self, layer)

    monkeypatch.setattr(HostLoad, "copy_layer", failing_once)
    return failures


def test_a_failed_host_load_fails_its_request_and_leaves_the_entries_on_the_host(checkpoint, hf_greedy,
                                                                                  monkeypatch):
    """The background copy raises at layer 1: the request resuming from it ends with an error, the
    half-loaded pages and checkpoint go back, and the next request loads the prefix again, correctly."""
    engine = engine_for(checkpoint, "tiny", max_batch_size=2, num_pages=13, max_model_len=64, prefix_checkpoints=3,
                        host_cache_bytes=2**20)
    a, b = random_prompt(33, seed=50), random_prompt(33, seed=51)
    engine.generate([a], PARAMS)
    engine.generate([b], PARAMS)
    fail_the_first_host_copy(monkeypatch)
    (failed,) = engine.generate([a[:30] + [3]], PARAMS)
    assert failed.finish_reason == "error" and "loading a cached prefix back from host memory" in failed.error
    prompt = a[:30] + [4, 5]
    (out,) = engine.generate([prompt], PARAMS)
    assert out.cached_tokens == 24 and engine.cache.host_hits == 2
    assert_matches(hf_greedy, "tiny", prompt, out)
    assert_no_leaks(engine)
    assert_cleared(engine)


def test_a_failed_host_load_leaves_the_requests_decoding_beside_it_alone(checkpoint, hf_greedy, monkeypatch):
    """A request that resumes a prefix from host memory is prefilled without the decoders' rows (no mixed
    step): when its copy fails, it alone ends with an error, and a request decoding meanwhile goes on to
    transformers' tokens."""
    engine = engine_for(checkpoint, "tiny", max_batch_size=2, num_pages=13, max_model_len=64, prefix_checkpoints=3,
                        host_cache_bytes=2**20)
    a, b, calm_prompt = random_prompt(33, seed=50), random_prompt(33, seed=51), random_prompt(5, seed=52)
    engine.generate([a], PARAMS)
    engine.generate([b], PARAMS)  # a's prefix goes to the host tier
    calm = engine.add_request(calm_prompt, PARAMS)
    engine.step()  # its prefill: it decodes from now on
    failures = fail_the_first_host_copy(monkeypatch)
    doomed = engine.add_request(a[:30] + [3], PARAMS)
    final = {}
    while engine.has_unfinished():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    assert failures and final[doomed].finish_reason == "error"
    assert_matches(hf_greedy, "tiny", calm_prompt, final[calm])
    assert_no_leaks(engine)


def test_eviction_goes_in_rounds_leaves_first():
    """Under a full pool the cache evicts the leaves there are, least recently used first, before the
    entries their eviction exposes: a parent used more recently than another leaf still goes after it."""
    from inkling_compiled.cache import StatePool
    from inkling_compiled.cache.prefix import PrefixCache
    from inkling_compiled.config import InklingConfig
    from inkling_compiled.tiny import TINY_CONFIGS

    config = InklingConfig.from_dict({"model_type": "inkling_text", **TINY_CONFIGS["tiny"]})
    pool = StatePool(config, max_slots=2, num_pages=5, page_size=4, max_pages_per_seq=3, dtype=torch.float32)
    cache = PrefixCache(pool)
    a, b = [3, 4, 5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27, 28]

    def cache_prompt(rid, prompt, pages):
        pool.allocate(rid, 4 * pages)
        cache.insert(prompt, pages, pool.pages_of[rid], {})
        pool.free(rid)

    cache_prompt("a", a, 2)  # a's two pages, used at time 1
    cache_prompt("a1", a[:4] + [99], 1)  # a's first page used again: time 2
    cache_prompt("b", b, 2)  # b's two pages: time 3; the pool is full
    assert pool.pages.num_free == 0 and cache.make_room(pages=2)
    assert cache.entry_at(a, 1) is not None and cache.entry_at(b, 1) is not None
    assert cache.entry_at(a, 2) is None and cache.entry_at(b, 2) is None

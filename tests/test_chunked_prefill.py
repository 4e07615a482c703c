"""Chunked prefill: a long prompt is prefilled over several steps, each chunk continuing its conv
windows and attending to the keys of the chunks before it through the cache; decoding requests keep
their one token per step meanwhile. The oracle is transformers, batch 1."""

import pytest

from inkling_compiled.engine import Engine
from inkling_compiled.step_plan import StepKind
from inkling_compiled.sampling import SamplingParams

from conftest import PARITY_CONFIGS, random_prompt

NEW = 6
PARAMS = SamplingParams(max_new_tokens=NEW, logprobs=True, ignore_eos=True)


class PrefillLog:
    """Wraps the engine's runner: the tokens of each prefill (extend) forward."""

    def __init__(self, engine):
        self.tokens: list[int] = []
        inner = engine.worker.runner.run

        def run(plan):
            if plan.kind is StepKind.EXTEND:  # prompt tokens (a mixed step's decoding rows lead it)
                self.tokens.append(sum(len(t) for t in plan.tokens[plan.decoding:]))
            return inner(plan)

        engine.worker.runner.run = run


def assert_matches(hf_greedy, name, prompt, out):
    want_tokens, want_logprobs = hf_greedy(name, prompt, NEW)
    assert out.token_ids == want_tokens
    assert max(abs(a - b) for a, b in zip(out.logprobs, want_logprobs.tolist())) < 1e-4


@pytest.mark.parametrize("name", PARITY_CONFIGS)
@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_prompts_match_transformers_while_others_decode(name, chunk, checkpoint, hf_greedy):
    """Prompt lengths put chunk boundaries inside and at the edge of the sliding window (8 / 5) and of
    the relative-bias extent (16 / 11); two short requests decode in the same steps."""
    engine = Engine.from_pretrained(checkpoint(name), compile=False, max_batch_size=6, prefill_chunk_tokens=chunk,
                                    progress=False)
    log = PrefillLog(engine)
    short = [random_prompt(n, seed=500 + n) for n in (2, 3)]
    long = [random_prompt(n, seed=600 + n) for n in (9, 17, 40, 150)]
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=60, logprobs=True, ignore_eos=True)) for p in short]
    rids += [engine.add_request(p, PARAMS) for p in long]
    final, decoded = {}, {rid: [] for rid in rids[:2]}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in decoded:
                decoded[out.request_id].append(len(out.token_ids))
            if out.finished:
                final[out.request_id] = out
    assert max(log.tokens) <= chunk  # no step prefills more than the budget
    assert len(log.tokens) >= sum(map(len, short + long)) // chunk  # and the long prompts took many steps
    for counts in decoded.values():  # the short requests advanced by one token every step until done
        assert counts == list(range(1, len(counts) + 1))
    for prompt, rid in zip(long, rids[2:]):
        assert_matches(hf_greedy, name, prompt, final[rid])
    for prompt, rid in zip(short, rids[:2]):
        want, _ = hf_greedy(name, prompt, 60)
        assert final[rid].token_ids == want


def test_prefill_budgets_default_to_a_chunk_beside_decoders_and_more_alone(checkpoint, hf_greedy):
    """Defaults: 256 tokens a step beside decoders, 2048 with none; a chunk set alone caps both. A lone
    300-token prompt then prefills in one step (its first token comes with it), and its output is
    transformers'; beside a decoding request a prompt as long takes two."""
    tiny = checkpoint("tiny")
    default = Engine.from_pretrained(tiny, compile=False, max_batch_size=2, progress=False)
    assert (default.worker.prefill_chunk_tokens, default.worker.idle_prefill_tokens) == (256, 2048)
    capped = Engine.from_pretrained(tiny, compile=False, max_batch_size=2, prefill_chunk_tokens=64, progress=False)
    assert (capped.worker.prefill_chunk_tokens, capped.worker.idle_prefill_tokens) == (64, 64)
    prompt = random_prompt(300, seed=650)
    alone = default.add_request(prompt, PARAMS)
    (first,) = default.step()
    assert first.request_id == alone and len(first.token_ids) == 1
    final = {}
    while default.has_unfinished():
        final.update((o.request_id, o) for o in default.step() if o.finished)
    assert_matches(hf_greedy, "tiny", prompt, final[alone])
    default.add_request(random_prompt(4, seed=651), PARAMS)
    default.step()  # the short prompt's prefill: it decodes from now on
    beside = default.add_request(random_prompt(300, seed=652), PARAMS)
    default.step()
    assert default.scheduler.get(beside).prefilled == 256


def test_compiled_decode_after_chunked_prefill(checkpoint, hf_greedy):
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=True, max_batch_size=4, buckets=(1, 4),
                                    prefill_chunk_tokens=7, progress=False)
    prompts = [random_prompt(n, seed=700 + n) for n in (5, 23, 64)]
    for prompt, out in zip(prompts, engine.generate(prompts, PARAMS)):
        assert_matches(hf_greedy, "tiny", prompt, out)


def test_a_fault_in_a_middle_chunk_fails_that_request_and_is_reported(checkpoint, hf_greedy):
    """A prompt whose second of four chunks fails ends with finish_reason="error" (it samples nothing in
    that step, yet its end is reported); a request decoding beside it in a forward of its own is untouched
    (in a mixed step it would fail with the prompt: test_reliability.py); nothing leaks."""
    from test_reliability import FaultyKernel

    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=2, prefill_chunk_tokens=10,
                                    mixed_steps=False, progress=False)
    short, long = random_prompt(3, seed=800), random_prompt(40, seed=801)
    calm = engine.add_request(short, PARAMS)
    engine.step()  # the short prompt's prefill
    doomed = engine.add_request(long, PARAMS)
    engine.step()  # the long prompt's first chunk
    layers = engine.config.num_hidden_layers
    fault = FaultyKernel("sconv_extend", fail_at=2 * layers)  # mid-forward of the second chunk
    try:
        outs = {o.request_id: o for o in engine.step()}
    finally:
        fault.remove()
    assert outs[doomed].finish_reason == "error" and "injected fault" in outs[doomed].error
    final = {}
    while engine.has_unfinished():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    assert_matches(hf_greedy, "tiny", short, final[calm])
    assert not engine.scheduler.prefilling and engine.worker.pool.slots.num_free == engine.worker.pool.slots.capacity


def test_an_interrupt_in_a_middle_chunk_is_reported_and_frees_its_checkpoints(checkpoint):
    """KeyboardInterrupt inside the forward of a prompt's middle chunk propagates, the request comes back
    with finish_reason="error" from the next step, and the checkpoints planned for it go back."""
    engine = Engine.from_pretrained(checkpoint("tiny"), compile=False, max_batch_size=2, prefill_chunk_tokens=16,
                                    page_size=4, prefix_checkpoints=8, progress=False)
    rid = engine.add_request(random_prompt(40, seed=900), PARAMS)
    engine.step()  # first chunk
    inner = engine.worker.runner.run

    def interrupted(plan):
        if plan.kind is StepKind.EXTEND:
            raise KeyboardInterrupt
        return inner(plan)

    engine.worker.runner.run = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.worker.runner.run = inner
    outs = {o.request_id: o.finish_reason for o in engine.step()}
    assert outs == {rid: "error"} and not engine.has_unfinished()
    engine.clear_prefix_cache()
    assert engine.worker.pool.checkpoints.num_free == engine.worker.pool.checkpoints.capacity
    assert engine.worker.pool.pages.num_free == engine.worker.pool.pages.capacity


@pytest.mark.parametrize("name, chunk, inner", [("tiny", 1, "eager"), ("tiny", 7, "aot_eager"), ("tiny", 64, "eager"),
                                                ("tiny-k3", 1, "eager"), ("tiny-k3", 7, "eager"),
                                                ("tiny-k3", 64, "eager")])
def test_compiled_extend_matches_transformers_in_one_graph_while_others_decode(name, chunk, inner, checkpoint,
                                                                               hf_greedy):
    """Every prefill chunk runs the one compiled extend graph (rows and tokens symbolic): chunks of 1, 7
    and 64 over prompts of 9 to 150 tokens, arriving while others decode, give transformers' tokens; the
    graph has every conv stream's `sconv_extend` and one `cached_extend_attention` per layer, no graph
    breaks, and the schedule compiles nothing after warm-up."""
    import torch

    from inkling_compiled.graphs import GraphRecorder, census
    from inkling_compiled.streams import STREAM_NAMES

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    recorder = GraphRecorder(inner)
    engine = Engine.from_pretrained(checkpoint(name), compile=True, compile_backend=recorder, max_batch_size=6,
                                    buckets=(1, 2, 6), prefill_chunk_tokens=chunk, prefix_cache=False,
                                    progress=False)
    layers = engine.config.num_hidden_layers
    assert len(recorder.graphs) == 2 and not torch._dynamo.utils.counters["graph_break"]
    extend = census(recorder.graphs[1])
    assert extend["ops"]["inkling::cached_extend_attention"] == layers
    assert sorted((c["layer"], c["stream"]) for c in extend["custom_calls"] if c["op"] == "inkling::sconv_extend") == \
        sorted((layer, s) for layer in range(layers) for s in STREAM_NAMES)
    assert "inkling::sconv_decode" not in extend["ops"] and "inkling::extend_attention" not in extend["ops"]
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = []
    run = engine.worker.extender.run
    engine.worker.extender.run = lambda bucket, **kw: compiled.append(bucket) or run(bucket, **kw)
    log = PrefillLog(engine)
    short = [random_prompt(n, seed=800 + n) for n in (2, 3)]
    long = [random_prompt(n, seed=900 + n) for n in (9, 17, 40, 150)]
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=30, logprobs=True, ignore_eos=True)) for p in short]
    final = {}
    for step in range(10_000):
        if step % 3 == 0 and len(rids) < len(short) + len(long):  # the long prompts arrive one by one
            rids.append(engine.add_request(long[len(rids) - len(short)], PARAMS))
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished() and len(rids) == len(short) + len(long):
            break
    assert len(compiled) == len(log.tokens) > len(long)  # every extend step ran the compiled graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    for prompt, rid in zip(long, rids[2:]):
        assert_matches(hf_greedy, name, prompt, final[rid])
    for prompt, rid in zip(short, rids[:2]):
        assert final[rid].token_ids == hf_greedy(name, prompt, 30)[0]
    torch._dynamo.reset()


@pytest.mark.parametrize("name", PARITY_CONFIGS)
def test_compiled_extend_takes_the_prefix_checkpoints_later_prompts_resume_from(name, checkpoint, hf_greedy):
    """With the prefix cache on, the compiled extend graph takes the conv and ring checkpoints at page
    boundaries (any number per step, none included): a later prompt sharing 32 tokens resumes from the
    state saved there, and both answers are transformers'. Nothing runs eagerly or recompiles."""
    import torch

    from inkling_compiled.graphs import GraphRecorder

    torch._dynamo.reset()
    recorder = GraphRecorder("aot_eager")
    engine = Engine.from_pretrained(checkpoint(name), compile=True, compile_backend=recorder, max_batch_size=2,
                                    buckets=(1, 2), prefill_chunk_tokens=20, progress=False)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = []
    run = engine.worker.extender.run
    engine.worker.extender.run = lambda bucket, **kw: compiled.append(bucket) or run(bucket, **kw)
    log = PrefillLog(engine)
    first = random_prompt(45, seed=1000)
    second = first[:33] + random_prompt(12, seed=1001)
    got_first = engine.generate([first], PARAMS)[0]
    got_second = engine.generate([second], PARAMS)[0]
    assert got_second.cached_tokens == 32  # two pages of 16, their state from the first prompt's checkpoints
    assert len(compiled) == len(log.tokens) >= 4 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
    assert_matches(hf_greedy, name, first, got_first)
    assert_matches(hf_greedy, name, second, got_second)
    torch._dynamo.reset()


@pytest.mark.parametrize("mixed", [True, False])
def test_a_prompt_arriving_while_others_decode_shares_their_forward(mixed, checkpoint, hf_greedy):
    """Mixed steps (the default): the step that prefills a new prompt decodes the running requests in the
    same compiled forward, an extend plan led by one row each, and every request still gets transformers'
    tokens and logprobs; with `mixed_steps=False` the decode is a forward of its own before the prefill."""
    engine = Engine.from_pretrained(checkpoint("tiny"), max_batch_size=4, buckets=(1, 2, 4), mixed_steps=mixed,
                                    progress=False)
    forwards: list[list[tuple[StepKind, int]]] = []  # per engine step: each forward's kind and decoding rows
    execute = engine.worker.execute

    def logged(plan, *args, **kwargs):
        forwards[-1].append((plan.kind, plan.decoding))
        return execute(plan, *args, **kwargs)

    engine.worker.execute = logged
    prompts = [random_prompt(n, seed=950 + n) for n in (5, 11, 23)]
    rids, final = [], {}
    for step in range(40):
        if step % 2 == 0 and len(rids) < len(prompts):  # an arrival every other step, beside 0, 1 and 2 decoders
            rids.append(engine.add_request(prompts[len(rids)], PARAMS))
        forwards.append([])
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    arrivals = [forwards[0], forwards[2], forwards[4]]
    if mixed:
        assert arrivals == [[(StepKind.EXTEND, 0)], [(StepKind.EXTEND, 1)], [(StepKind.EXTEND, 2)]]
    else:
        assert arrivals == [[(StepKind.EXTEND, 0)], [(StepKind.DECODE, 0), (StepKind.EXTEND, 0)],
                            [(StepKind.DECODE, 0), (StepKind.EXTEND, 0)]]
    assert engine.scheduler.counters["decode_tokens"] == len(prompts) * (NEW - 1)  # first tokens come from prefill
    for prompt, rid in zip(prompts, rids):
        assert_matches(hf_greedy, "tiny", prompt, final[rid])

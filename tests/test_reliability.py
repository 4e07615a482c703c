"""Reliability: requests isolated from each other (non-finite values included), a failed step never
wedges the engine, concurrent callers, and the engine's own state protected from the caller's."""

import threading

import pytest
import torch

from inkling_compiled.engine import Engine
from inkling_compiled.sampling import SamplingParams

from conftest import random_prompt

GREEDY = SamplingParams(max_new_tokens=6, logprobs=True, ignore_eos=True)
POISON = 7  # a token id whose embedding row the isolation tests set to NaN


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def make_engine(checkpoint, compiled: bool, **kw):
    kw.setdefault("max_batch_size", 4)
    if compiled:
        kw.update(compile=True, buckets=(1, 2, 4), compile_backend="inductor", progress=False)
    else:
        kw.update(compile=False)
    return Engine.from_pretrained(checkpoint("tiny"), **kw)


def clean_prompt(length, seed):
    return [t if t != POISON else POISON + 1 for t in random_prompt(length, seed=seed)]


def outputs(engine, prompts, params=GREEDY):
    return [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)]


def assert_same(got, want):
    """Same tokens; logprobs within 1e-4 (another batch composition rounds differently) and finite."""
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert all(abs(x - y) < 1e-4 for x, y in zip(a, b)), (a, b)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_poisoned_request_leaves_the_others_and_its_slots_successor_alone(compiled, checkpoint):
    engine = make_engine(checkpoint, compiled)
    clean = [clean_prompt(n, seed=100 + n) for n in (5, 13, 21)]  # ring wrap-around (window 8) included
    want = outputs(engine, clean)  # before any poison
    with torch.no_grad():
        engine.model.model.embed_tokens.weight[POISON] = float("nan")
    bad = clean_prompt(11, seed=7)
    bad[4] = POISON
    # packed in one prefill with the poisoned prompt, then decoded beside it
    got = outputs(engine, [clean[0], bad, clean[1]])
    assert_same([got[0], got[2]], [want[0], want[1]])
    # the poisoned request's slot (and ring, and pages) go to the next request
    assert_same(outputs(engine, [clean[2]]), [want[2]])
    assert_same(outputs(engine, clean), want)


def poison_dummies(pool):
    """NaN into everything padded rows may touch: slot 0's conv windows and ring rows, page 0."""
    W = pool.config.sliding_window_size
    for t in (t for layers in pool.conv.values() for t in layers):
        t[0] = float("nan")
    for t in (t for layers in pool.global_kv for t in layers):
        t[:pool.page_size] = float("nan")
    for t in (t for layers in pool.sliding_kv for t in layers):
        t[:W] = float("nan")


def test_padded_rows_and_the_dummy_slot_and_page_never_reach_a_live_row(checkpoint):
    eager, compiled = make_engine(checkpoint, False), make_engine(checkpoint, True)
    prompts = [clean_prompt(n, seed=200 + n) for n in (4, 9, 17)]  # 3 rows in bucket 4: one padded row
    want = outputs(eager, prompts)
    poison_dummies(compiled.worker.pool)
    assert_same(outputs(compiled, prompts), want)


# ---- a failed step is contained ---------------------------------------------------------------------

class FaultyKernel:
    """Replaces an op's CPU kernel: delegates to the reference, raises on call number `fail_at` (mid-step)."""

    def __init__(self, op: str, fail_at: int, error: type[BaseException] = RuntimeError):
        from inkling_compiled.custom_ops import KERNELS

        self.reference, self.fail_at, self.calls, self.error = KERNELS[op]["reference"], fail_at, 0, error
        self.lib = torch.library.Library("inkling", "IMPL")
        self.lib.impl(op, self, "CPU")

    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error("injected fault")
        return self.reference(*args)

    def remove(self):
        self.lib._destroy()  # the C++ kernel serves again


@pytest.mark.parametrize("compiled", [False, True])
def test_a_fault_inside_an_op_fails_that_steps_requests_and_nothing_else(compiled, checkpoint):
    engine = make_engine(checkpoint, compiled)
    prompts = [clean_prompt(n, seed=300 + n) for n in (5, 12, 7)]
    want = outputs(make_engine(checkpoint, False), prompts)
    params = SamplingParams(max_new_tokens=6, logprobs=True, ignore_eos=True)
    first, second = (engine.add_request(p, params) for p in prompts[:2])
    engine.step()  # prefill both
    layers = engine.config.num_hidden_layers
    fault = FaultyKernel("sconv_decode", fail_at=2 * layers + 1)  # third layer of the first decode step
    try:
        outs = {o.request_id: o for o in engine.step()}
    finally:
        fault.remove()
    assert fault.calls == 2 * layers + 1  # it really raised mid-step
    # inductor's C++ launcher reports a failed op call without the op's own message
    cause = "inkling::sconv_decode" if compiled else "injected fault"
    for rid in (first, second):
        assert outs[rid].finish_reason == "error" and cause in outs[rid].error
        assert len(outs[rid].token_ids) == 1  # the prefill's token; nothing from the failed step
    assert not engine.scheduler.running and engine.worker.pool.slots.num_free == engine.worker.pool.slots.capacity
    engine.clear_prefix_cache()  # cached prompt pages are held on purpose; the rest must be free
    assert engine.worker.pool.pages.num_free == engine.worker.pool.pages.capacity
    # the engine keeps serving, and the freed slots carry nothing of the failed requests
    assert_same(outputs(engine, prompts), want)


def test_sampling_fields_the_step_cannot_represent_are_refused():
    from inkling_compiled.errors import RequestError

    for bad in (dict(top_k=2**63), dict(top_k=2**31), dict(max_new_tokens=2**40), dict(temperature=1e39),
                dict(top_p=1e-60), dict(seed=2**64), dict(seed=-1), dict(temperature=float("inf")),
                dict(logprobs="yes"), dict(stop_token_ids="12")):
        with pytest.raises(RequestError, match="invalid sampling parameters: " + next(iter(bad))):
            SamplingParams(**bad)
    SamplingParams(top_k=2**31 - 1, seed=2**64 - 1, max_new_tokens=2**31 - 1, top_p=1e-30)  # the edges pass


@pytest.mark.parametrize("mixed", [False, True])
def test_an_interrupt_in_the_prefill_fails_the_rows_of_its_forward_only(checkpoint, mixed):
    """Unmixed, the decode is a forward of its own, before the prefill: the request it finished stays
    finished (not decoded again). Mixed, it decodes inside the prefill's forward, and an interrupt there
    fails every row (a decoding row's state is as half-written as a prompt's). Either way their slots
    go back and the engine serves on."""
    engine = make_engine(checkpoint, False, mixed_steps=mixed)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    first = engine.add_request(clean_prompt(5, seed=1), params)
    engine.step()  # prefill: token 1 of 2
    second = engine.add_request(clean_prompt(6, seed=2), params)
    fault = FaultyKernel("sconv_extend", fail_at=1, error=KeyboardInterrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.step()  # `first` decodes its last token, then (or in the same forward) `second` is interrupted
    finally:
        fault.remove()
    outs = {o.request_id: o for o in engine.step()}
    assert (outs[first].finish_reason, len(outs[first].token_ids)) == (("error", 1) if mixed else ("length", 2))
    assert outs[second].finish_reason == "error"
    assert not engine.has_unfinished() and engine.worker.pool.slots.num_free == engine.worker.pool.slots.capacity
    (again,) = engine.generate([clean_prompt(5, seed=1)], params)
    assert again.finish_reason == "length" and len(again.token_ids) == 2


def test_an_interrupted_generate_hands_its_requests_to_step(checkpoint):
    engine = make_engine(checkpoint, False, max_batch_size=2)
    prompts = [clean_prompt(4 + i, seed=700 + i) for i in range(5)]  # 5 requests, 2 slots: 3 wait
    fault = FaultyKernel("sconv_decode", fail_at=2 * 16 + 1, error=KeyboardInterrupt)  # the third decode step
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    finally:
        fault.remove()
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(finished) == 5  # every request's final output reaches step(), failed or not
    assert {o.finish_reason for o in finished.values()} == {"error", "length"}
    assert engine.worker.pool.slots.num_free == engine.worker.pool.slots.capacity


def test_an_interrupt_mid_step_fails_that_steps_requests_then_propagates(checkpoint):
    """Ctrl-C inside a forward: the half-stepped requests must not carry on with corrupt state."""
    engine = make_engine(checkpoint, False)
    prompts = [clean_prompt(n, seed=500 + n) for n in (6, 9)]
    want = outputs(engine, prompts)
    rids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    fault = FaultyKernel("sconv_decode", fail_at=3, error=KeyboardInterrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    finally:
        fault.remove()
    outs = {o.request_id: o for o in engine.step()}  # the failed requests' final outputs come next
    assert {rid: outs[rid].finish_reason for rid in rids} == {rid: "error" for rid in rids}
    assert "KeyboardInterrupt" in outs[rids[0]].error
    assert not engine.has_unfinished() and engine.worker.pool.slots.num_free == engine.worker.pool.slots.capacity
    assert_same(outputs(engine, prompts), want)


# ---- several threads, one engine ---------------------------------------------------------------------

def run_concurrently(*targets, timeout=120) -> list[BaseException]:
    """Runs each callable on its own thread; the exceptions they raised. Fails if one never returns."""
    errors = []

    def guarded(target):
        try:
            target()
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a thread never returned"
    return errors


def test_threads_adding_aborting_and_stepping_leave_every_request_finished_and_nothing_leaked(checkpoint):
    import random

    engine = make_engine(checkpoint, False, max_model_len=64, page_size=4)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    added, finished = [], {}
    lock = threading.Lock()

    def producer(seed):
        rng = random.Random(seed)
        for i in range(40):
            rid = engine.add_request(clean_prompt(rng.randint(1, 20), seed=seed * 100 + i), params)
            with lock:
                added.append(rid)
            if rng.random() < 0.3:
                try:
                    engine.abort(rid)
                except Exception as e:  # it may have finished already: only that error is allowed
                    assert "no unfinished request" in str(e)

    def stepper():
        for _ in range(400):
            for out in engine.step():
                if out.finished:
                    with lock:
                        assert out.request_id not in finished, "a request finished twice"
                        finished[out.request_id] = out

    errors = run_concurrently(lambda: producer(1), lambda: producer(2), stepper, stepper)
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert not errors, errors
    assert sorted(finished) == sorted(added) and len(set(added)) == 80
    assert {o.finish_reason for o in finished.values()} <= {"length", "abort"}
    assert engine.worker.pool.slots.num_free == engine.worker.pool.slots.capacity
    engine.clear_prefix_cache()  # cached prompt pages are held on purpose; the rest must be free
    assert engine.worker.pool.pages.num_free == engine.worker.pool.pages.capacity


def test_generate_hands_other_requests_outputs_to_the_next_step(checkpoint):
    engine = make_engine(checkpoint, False)
    rid = engine.add_request(clean_prompt(6, seed=1), SamplingParams(max_new_tokens=2, ignore_eos=True))
    (mine,) = engine.generate([clean_prompt(5, seed=2)], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert len(mine.token_ids) == 6
    assert engine.has_unfinished()
    delivered = engine.step()
    assert [(o.request_id, o.finished, len(o.token_ids)) for o in delivered] == [(rid, True, 2)]
    assert not engine.has_unfinished()


def test_generate_beside_other_threads_generating_and_stepping(checkpoint):
    """Each generate() gets its own outputs, whoever stepped them; a streaming stepper gets its own once."""
    engine = make_engine(checkpoint, False)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    prompts = {name: clean_prompt(4 + i, seed=600 + i) for i, name in enumerate("abcd")}
    want = {name: outputs(engine, [p], params)[0][0] for name, p in prompts.items()}
    got, streamed = {}, {}
    streamer_rid = engine.add_request(prompts["d"], params)

    def generating(name):
        got[name] = engine.generate([prompts[name]], params)[0].token_ids

    def stepping():
        for _ in range(200):
            for out in engine.step():
                assert out.request_id not in streamed, "a final output delivered twice"
                if out.finished:
                    streamed[out.request_id] = out.token_ids

    errors = run_concurrently(*(lambda n=n: generating(n) for n in "abc"), stepping)
    assert not errors, errors
    assert got == {n: want[n] for n in "abc"}
    assert streamed == {streamer_rid: want["d"]}
    assert not engine.has_unfinished()


# ---- the caller's torch state ------------------------------------------------------------------------

def test_one_engines_replay_never_refuses_another_engines_first_compile(checkpoint):
    """The fail-on-recompile stance is process-wide: while engine A replays under it on one thread,
    engine B's lazy first compile on another must wait, not be refused (its requests used to fail)."""
    a = Engine.from_pretrained(checkpoint("tiny"), max_batch_size=2, compile_backend="eager", progress=False)
    b = Engine.from_pretrained(checkpoint("tiny"), max_batch_size=2, compile_backend="eager", progress=False,
                               warmup=False)
    inside, release = threading.Event(), threading.Event()
    replay = a.worker.decoder.compiled

    def slow_replay():
        out = replay()
        inside.set()
        release.wait(10)
        return out

    a.worker.decoder.compiled = slow_replay
    a.add_request([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))
    a.step()  # prefill
    stepping = threading.Thread(target=a.step)
    stepping.start()
    assert inside.wait(10)  # A is replaying, under the stance
    outs = []
    compiling = threading.Thread(target=lambda: outs.extend(b.generate([[8, 9]], SamplingParams(max_new_tokens=3))))
    compiling.start()
    compiling.join(0.5)  # B reaches its first compile while A is still inside
    release.set()
    stepping.join(10)
    compiling.join(60)
    assert [o.finish_reason for o in outs] == ["length"], [o.error for o in outs]


def test_the_callers_torch_state_never_reaches_a_compiled_step(checkpoint):
    engine = make_engine(checkpoint, True)
    prompts = [clean_prompt(n, seed=400 + n) for n in (3, 10)]
    want = outputs(engine, prompts)
    threads, dtype, precision = torch.get_num_threads(), torch.get_default_dtype(), torch.get_float32_matmul_precision()
    fp16_reduce = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    try:
        torch.set_num_threads(2)
        torch.set_default_dtype(torch.float64)
        torch.set_float32_matmul_precision("high")  # allow_tf32, which Dynamo guards on
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = not fp16_reduce
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = outputs(engine, prompts)
            assert torch.is_autocast_enabled("cpu")  # restored for the caller
        assert torch.get_num_threads() == 2 and torch.get_default_dtype() == torch.float64
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.set_float32_matmul_precision(precision)
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = fp16_reduce
    assert_same(got, want)


def test_bf16_on_cpu_serves_and_stays_near_fp32(checkpoint):
    bf16 = make_engine(checkpoint, False, dtype=torch.bfloat16)
    fp32 = make_engine(checkpoint, False)
    prompt = clean_prompt(19, seed=5)  # past the sliding window, so the paged (global) kernel reads pages
    out = bf16.generate([prompt], GREEDY)[0]
    ref = fp32.generate([prompt], GREEDY)[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert all(abs(a - b) < 0.5 for a, b in zip(out.logprobs, ref.logprobs))  # bf16 drift, not garbage


# ---- everything at once ---------------------------------------------------------------------------------

def random_params(rng, vocab_hint: int) -> SamplingParams:
    kind = rng.random()
    stop = tuple(rng.sample(range(3, vocab_hint), 30)) if rng.random() < 0.3 else ()  # likely to be hit
    common = dict(max_new_tokens=rng.randint(1, 8), stop_token_ids=stop, ignore_eos=rng.random() < 0.7,
                  logprobs=True)
    if kind < 0.4:
        return SamplingParams(**common)
    return SamplingParams(temperature=rng.choice([0.6, 1.0, 1.4]), top_k=rng.choice([0, 5, 50]),
                          top_p=rng.choice([1.0, 0.9, 0.5]), seed=rng.getrandbits(64), **common)


def test_a_random_schedule_serves_every_request_as_if_it_were_alone(checkpoint):
    """A few hundred events with a fixed seed: arrivals, aborts, stop tokens, eos, batch sizes crossing
    the buckets (1, 2, 4), greedy and seeded sampling, and faults injected into some steps. Every request
    finishes exactly once; those that were not aborted or failed give their solo run's tokens; nothing
    leaks."""
    import random

    engine = make_engine(checkpoint, True, max_model_len=40, page_size=4)
    rng = random.Random(2026)
    requests, live, finished, faulted = {}, [], {}, 0
    for event in range(300):
        roll = rng.random()
        if roll < 0.35:
            prompt = clean_prompt(rng.randint(1, 20), seed=event)
            params = random_params(rng, 260)
            rid = engine.add_request(prompt, params)
            requests[rid] = (prompt, params)
            live.append(rid)
        elif roll < 0.43 and live:
            engine.abort(live.pop(rng.randrange(len(live))))
        else:
            fault = FaultyKernel("sconv_decode", fail_at=rng.randint(1, 16)) if rng.random() < 0.04 else None
            try:
                outs = engine.step()
            finally:
                if fault is not None:
                    faulted += fault.calls >= fault.fail_at
                    fault.remove()
            for out in outs:
                if out.finished:
                    assert out.request_id not in finished, "finished twice"
                    finished[out.request_id] = out
                    if out.request_id in live:
                        live.remove(out.request_id)
        assert engine.worker.pool.slots.num_free == engine.worker.pool.slots.capacity - len(engine.scheduler.running)
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == sorted(requests)
    reasons = [o.finish_reason for o in finished.values()]
    assert faulted >= 1 and reasons.count("error") >= 1 and reasons.count("abort") >= 1
    assert reasons.count("stop") >= 1 and reasons.count("length") >= 1
    assert engine.worker.pool.slots.num_free == engine.worker.pool.slots.capacity
    engine.clear_prefix_cache()  # cached prompt pages are held on purpose; the rest must be free
    assert engine.worker.pool.pages.num_free == engine.worker.pool.pages.capacity
    assert not engine.worker.pool.slot_of and engine.worker.pool.block_table.abs().sum() == 0
    compared = 0
    for rid, out in finished.items():
        if out.finish_reason in ("abort", "error"):
            continue
        prompt, params = requests[rid]
        alone = engine.generate([prompt], params)[0]
        assert (out.token_ids, out.finish_reason) == (alone.token_ids, alone.finish_reason), rid
        assert all(abs(a - b) < 1e-4 for a, b in zip(out.logprobs, alone.logprobs))
        compared += 1
    assert compared >= 40

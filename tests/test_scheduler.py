"""The scheduler alone, no model: driven by a scripted "model" whose next token is a hash of the whole
sequence so far, through arrivals, chunked prefill, prefix-cache hits and their checkpoints, drafts,
stops and aborts. The stand-in worker keeps each slot's tokens itself, from what the plans say (the
journal's slot resets and checkpoint restores included), so a plan that names a wrong slot, position,
chunk or checkpoint shows up as wrong tokens against a plain reference loop over each request alone.
Every plan goes through msgpack before it is executed, as the tensor-parallel channel sends it."""

import random

import msgspec
import pytest
import torch

from inkling_compiled.cache import StatePool
from inkling_compiled.cache.manager import CacheManager
from inkling_compiled.config import InklingConfig
from inkling_compiled.graphs import Buckets
from inkling_compiled.kv_layout import pages_for
from inkling_compiled.requests import Request
from inkling_compiled.sampling import SamplingParams
from inkling_compiled.scheduler import Scheduler
from inkling_compiled.step_plan import Sampled, StepKind, StepPlan
from inkling_compiled.tiny import TINY_CONFIGS

VOCAB, STOP = 40, 7
PAGE, MAX_LEN = 4, 96


def next_token(seq: list[int]) -> int:
    """The scripted model: depends on every token and on the length, rarely the stop token."""
    h = len(seq)
    for t in seq:
        h = (h * 1000003 + t) % 2147483647
    return 3 + h % (VOCAB - 3)


def reference(prompt: list[int], max_new: int, stops: frozenset) -> list[int]:
    seq, out = list(prompt), []
    budget = min(len(prompt) + max_new, MAX_LEN)
    while True:
        t = next_token(seq)
        out.append(t)
        seq.append(t)
        if t in stops or len(out) >= max_new or len(seq) >= budget:
            return out


class ScriptedWorker:
    """Executes plans on per-slot token lists: what a real worker's pool would hold."""

    def __init__(self):
        self.slots: dict[int, list[int]] = {}
        self.checkpoints: dict[int, list[int]] = {}
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> Sampled:
        plan = msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan)
        self.plans.append(plan)
        for effect in plan.journal:
            if effect.name == "reset_slot":
                self.slots[effect.args[0]] = []
            elif effect.name == "restore_checkpoint":
                slot, index = effect.args
                self.slots[slot] = list(self.checkpoints[index])
        tokens = []
        accepted = []
        for row, (slot, feed, start) in enumerate(zip(plan.slots, plan.tokens, plan.starts)):
            state = self.slots[slot]
            assert start == len(state), (plan.kind, row, start, len(state))
            if plan.kind is StepKind.EXTEND:
                full = state + feed
                for c in plan.checkpoints:
                    if c.row == row:
                        assert c.boundary % PAGE == 0 and start < c.boundary <= len(full)
                        assert c.first == start
                        self.checkpoints[c.index] = full[:c.boundary]
                self.slots[slot] = full
                tokens.append([next_token(full)])
            elif plan.kind is StepKind.DECODE:
                state.append(feed[0])
                tokens.append([next_token(state)])
            else:  # verify: the target's token after each prefix; drafts accepted while they match
                newest, drafts = feed[0], feed[1:]
                seq, row_tokens, n = state + [newest], [], 0
                for i in range(len(drafts) + 1):  # past the first rejection: tokens never emitted
                    row_tokens.append(next_token(seq))
                    if n == i and i < plan.drafted[row] and drafts[i] == row_tokens[-1]:
                        n += 1
                        seq = seq + [drafts[i]]
                accepted.append(n)
                self.slots[slot] = state + [newest] + drafts[:n]
                tokens.append(row_tokens)
        width = [len(t) for t in tokens]
        return Sampled(tokens=tokens, logprobs=[[0.0] * w for w in width], top_ids=[[[]] * w for w in width],
                       top_logprobs=[[[]] * w for w in width], accepted=accepted)


class Drafts:
    """Guesses the target's next K tokens, right or wrong at random (seeded): accepted runs of every length."""

    def __init__(self, k: int, seed: int):
        self.k, self.rng = k, random.Random(seed)

    def propose(self, reqs: list[Request]) -> list[list[int] | None]:
        drafts = []
        for r in reqs:
            if self.rng.random() < 0.2:
                drafts.append(None)
                continue
            seq, guess = r.prompt + r.output, []
            for _ in range(self.rng.randint(1, self.k)):
                t = next_token(seq) if self.rng.random() < 0.7 else self.rng.randrange(3, VOCAB)
                guess.append(t)
                seq = seq + [t]
            drafts.append(guess)
        return drafts


def make_scheduler(k: int = 0, chunk: int = 10, prefix_cache: bool = True, idle: int | None = None):
    config = InklingConfig.from_dict({"model_type": "inkling_text", **TINY_CONFIGS["tiny"]})
    pool = StatePool(config, max_slots=6, num_pages=6 * pages_for(MAX_LEN, PAGE) + 1, page_size=PAGE,
                     max_pages_per_seq=pages_for(MAX_LEN, PAGE), dtype=torch.float32, checkpoints=6,
                     spec_draft_tokens=k + 1 if k else 0)
    cache = CacheManager(pool, prefix_cache=prefix_cache)
    return Scheduler(cache, Buckets((1, 2, 4)), max_batch_size=6, prefill_chunk_tokens=chunk, idle_prefill_tokens=idle,
                     draft_tokens=k, vocab_size=VOCAB, logits_vocab_size=VOCAB), pool


def run(scheduler: Scheduler, worker: ScriptedWorker, arrivals: dict[int, list[Request]], drafter=None,
        aborts: dict[int, str] | None = None, steps: int = 400) -> dict[str, Request]:
    """The engine's loop, minus the model: decode batches first, then one extend plan."""
    finished = {}
    for step in range(steps):
        for req in arrivals.get(step, []):
            scheduler.add(req)
        if aborts and step in aborts and scheduler.get(aborts[step]) is not None:
            req = scheduler.get(aborts[step])
            req.finish_reason = "abort"
            scheduler.finish(req)
            finished[req.request_id] = req
        batch = list(scheduler.running)
        plans = scheduler.decode_plans(batch, drafter.propose(batch) if drafter else None) if batch else []
        assert len({p.kind for p in plans}) <= 1 and sum(p.rows for p in plans) == len(batch)
        for plan in plans:
            assert plan.bucket == scheduler.buckets.bucket_for(plan.rows) and plan.rows <= 4
            reqs = scheduler.requests_of(plan)
            scheduler.record(plan, reqs, worker.execute(plan))
            for req in reqs:
                if req.finish_reason is not None:
                    scheduler.finish(req)
                    finished[req.request_id] = req
        # a step prefills at most a chunk beside running requests, and at most the idle budget alone
        budget = scheduler.prefill_chunk_tokens if scheduler.running else scheduler.idle_prefill_tokens
        plan = scheduler.extend_plan()
        if plan is not None:
            assert sum(len(t) for t in plan.tokens) <= budget
            reqs = scheduler.requests_of(plan)
            scheduler.record(plan, reqs, worker.execute(plan))
            scheduler.finish_extend(plan, reqs)
            for req in reqs:
                if req.finish_reason is not None:
                    scheduler.finish(req)
                    finished[req.request_id] = req
        if not scheduler.has_unfinished() and step > max(arrivals):
            return finished
    raise AssertionError("requests never finished")


def requests(seed: int, n: int, shared: list[int]) -> dict[int, list[Request]]:
    rng = random.Random(seed)
    arrivals: dict[int, list[Request]] = {}
    for i in range(n):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))]
        max_new = rng.randint(1, 25)
        params = SamplingParams(max_new_tokens=max_new)
        req = Request(str(i), prompt, params, 0, frozenset({STOP}), min(len(prompt) + max_new, MAX_LEN))
        arrivals.setdefault(rng.randint(0, 30), []).append(req)
    return arrivals


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("chunk, idle", [(5, None), (64, None), (5, 40)])
def test_scheduler_matches_a_plain_loop(k, chunk, idle):
    shared = [random.Random(1).randrange(3, VOCAB) for _ in range(13)]  # three full pages and a bit
    arrivals = requests(seed=10 + k + chunk, n=24, shared=shared)
    scheduler, pool = make_scheduler(k, chunk, idle=idle)
    worker = ScriptedWorker()
    done = run(scheduler, worker, arrivals, Drafts(k, seed=5) if k else None)
    for reqs in arrivals.values():
        for req in reqs:
            assert done[req.request_id].output == reference(req.prompt, req.params.max_new_tokens, req.stop_ids)
    kinds = {p.kind for p in worker.plans}
    assert kinds == ({StepKind.DECODE, StepKind.VERIFY, StepKind.EXTEND} if k else {StepKind.DECODE, StepKind.EXTEND})
    assert scheduler.cache.hits > 0 and any(p.checkpoints for p in worker.plans)  # the prefix cache was used
    assert max(len(p.slots) for p in worker.plans if p.kind is not StepKind.EXTEND) <= 4  # split over buckets
    assert pool.slots.num_free == pool.slots.capacity  # every slot went back
    if k:
        c = scheduler.counters
        assert 0 < c["spec_accepted"] < c["spec_proposed"]


def test_aborts_free_their_slot_and_leave_the_others_exact():
    arrivals = requests(seed=3, n=10, shared=[])
    scheduler, pool = make_scheduler(0, 8, prefix_cache=False)
    victims = {5: "0", 9: "3", 14: "7"}
    done = run(scheduler, ScriptedWorker(), arrivals, aborts=victims)
    for reqs in arrivals.values():
        for req in reqs:
            want = reference(req.prompt, req.params.max_new_tokens, req.stop_ids)
            got = done[req.request_id]
            if got.finish_reason == "abort":
                assert req.request_id in victims.values() and got.output == want[:len(got.output)]
            else:
                assert got.output == want
    assert any(done[v].finish_reason == "abort" for v in victims.values())
    assert pool.slots.num_free == pool.slots.capacity and pool.pages.num_free == pool.pages.capacity


def test_a_stop_token_finishes_mid_verify():
    """A verify row whose accepted drafts reach a stop token emits up to it, not past it."""
    scheduler, _ = make_scheduler(3, 64, prefix_cache=False)
    prompt = [5, 9, 11]
    want = reference(prompt, 40, frozenset())
    stop = want[6]  # the 7th token becomes a stop token
    req = Request("r", prompt, SamplingParams(max_new_tokens=40), 0, frozenset({stop}), 43)

    class Perfect:
        def propose(self, reqs):
            return [reference(r.prompt + r.output, 3, frozenset()) for r in reqs]

    done = run(scheduler, ScriptedWorker(), {0: [req]}, drafter=Perfect())
    assert done["r"].output == want[:want.index(stop) + 1] and done["r"].finish_reason == "stop"


def test_a_step_plan_round_trips_through_msgpack():
    scheduler, _ = make_scheduler(2, 64)
    for i in range(3):
        scheduler.add(Request(str(i), [4 + i] * (9 + i), SamplingParams(max_new_tokens=4, top_logprobs=3), 7, frozenset(),
                              20))
    plan = scheduler.extend_plan()
    assert plan.checkpoints and plan.journal and plan.kind is StepKind.EXTEND
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan)
    assert again == plan and again.top_logprobs == 3


def test_a_step_with_nothing_running_prefills_up_to_the_idle_budget_and_a_chunk_beside_decoders():
    scheduler, pool = make_scheduler(chunk=8, idle=32)
    worker = ScriptedWorker()
    params = SamplingParams(max_new_tokens=4)

    def request(rid: str, n: int) -> Request:
        prompt = [3 + (i * 7 + len(rid)) % (VOCAB - 3) for i in range(n)]
        return Request(rid, prompt, params, 0, frozenset({STOP}), n + 4)

    scheduler.add(request("alone", 40))
    first = scheduler.extend_plan()  # nothing decodes: the idle budget
    assert [len(t) for t in first.tokens] == [32]
    scheduler.record(first, scheduler.requests_of(first), worker.execute(first))
    scheduler.finish_extend(first, scheduler.requests_of(first))
    second = scheduler.extend_plan()  # still prefilling, nothing running yet: the rest in one step
    assert [len(t) for t in second.tokens] == [8] and second.sampled == [True]
    scheduler.record(second, scheduler.requests_of(second), worker.execute(second))
    scheduler.finish_extend(second, scheduler.requests_of(second))
    assert [r.request_id for r in scheduler.running] == ["alone"]
    scheduler.add(request("beside", 40))
    third = scheduler.extend_plan()  # a request decodes: one chunk
    assert [len(t) for t in third.tokens] == [8]

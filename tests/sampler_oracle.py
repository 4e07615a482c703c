"""The samplers of a decode and a verify step as plain Python loops over floats and ints (what the
`sample_tokens` and `verify_tokens` ops are checked against), and seeded cases for them.

Independent of both the ops' C++ and their torch references: the noise is hashed with Python ints, the
log-softmax, the filter and the Gumbel draw are computed in float64 one value at a time."""

from __future__ import annotations

import math

import torch

M32 = 0xFFFFFFFF


def mix32(x: int) -> int:
    for _ in range(2):
        x ^= x >> 16
        x = (x * 0x45D9F3B) & M32
    return x ^ (x >> 16)


def uniform(seed: int, counter: int, i: int) -> float:
    """The noise of (seed key, token counter, vocab id) in (0, 1)."""
    h = mix32(mix32(seed ^ ((counter * 0x27D4EB2D) & M32)) ^ ((i * 0x165667B1) & M32))
    return ((h >> 9) + 0.5) / 2**23


def log_softmax(x: list[float]) -> list[float]:
    if any(math.isnan(v) for v in x):  # as torch: a NaN anywhere makes every logprob NaN
        return [math.nan] * len(x)
    m = max(x)
    log_total = math.log(sum(math.exp(v - m) for v in x))
    return [(v - m) - log_total for v in x]


def rank(v: float) -> tuple:
    """Larger ranks first: torch's order, NaN above every number."""
    return (1, 0.0) if math.isnan(v) else (0, v)


def argmax(x: list[float]) -> int:
    return max(range(len(x)), key=lambda i: (rank(x[i]), -i))  # the first of equal maxima


def top(x: list[float], n: int) -> list[int]:
    """The n most likely ids (by their logits), equal values by lower id first."""
    return sorted(range(len(x)), key=lambda i: (tuple(-r for r in rank(x[i])), i))[:n]


def candidates(x: torch.Tensor, temperature: float, top_k: int, top_p: float) -> list[float]:
    """x / temperature (in fp32, as the step divides), -inf outside the top_k values and then outside the
    smallest prefix of them whose softmax mass reaches top_p (the top value always kept)."""
    scaled = (x / max(temperature, 1e-6)).tolist()
    V = len(scaled)
    k = top_k if 0 < top_k < V else V
    if k == V and top_p >= 1.0:
        return scaled
    order = sorted(scaled, reverse=True)[:k]
    total = sum(math.exp(v - order[0]) for v in order)
    threshold, before = order[0], 0.0
    for v in order:
        if before >= top_p:
            break
        threshold, before = v, before + math.exp(v - order[0]) / total
    return [v if v >= threshold else -math.inf for v in scaled]


def gumbel_draw(c: list[float], seed: int, counter: int, exclude: int = -1) -> int:
    """The first id of the largest c_i - ln(-ln u_i) (c_exclude as -inf); id 0 if every term is -inf."""
    best, at = -math.inf, 0
    for i, v in enumerate(c):
        term = -math.inf if i == exclude else v - math.log(-math.log(uniform(seed, counter, i)))
        if term > best:
            best, at = term, i
    return at


def sample_rows(logits, temperature, top_k, top_p, seed, counter, top_n):
    """(tokens, their logprobs, top ids, top logprobs) as lists, row by row."""
    tokens, chosen, ids, values = [], [], [], []
    for b in range(logits.shape[0]):
        x = logits[b].tolist()
        lp = log_softmax(x)
        t = float(temperature[b])
        if t > 0:
            c = candidates(logits[b], t, int(top_k[b]), float(top_p[b]))
            token = gumbel_draw(c, int(seed[b]), int(counter[b]))
        else:
            token = argmax(x)
        best = top(x, top_n)
        tokens.append(token), chosen.append(lp[token]), ids.append(best), values.append([lp[i] for i in best])
    return tokens, chosen, ids, values


def verify_rows(logits, inputs, drafted, temperature, top_k, top_p, seed, counter, top_n):
    """(tokens [B][T], accepted [B], their logprobs, top ids, top logprobs) as lists: position i checks the
    draft inputs[b][i + 1] (the last position a stand-in, inputs[b][0], clamped into the vocabulary); greedy
    rows accept the argmax, sampled rows with the draft's probability under their candidates against noise
    column V; the first position that does not accept (or has no real draft) takes its own token."""
    B, T, V = logits.shape
    out = ([], [], [], [], [])
    for b in range(B):
        t, key, start = float(temperature[b]), int(seed[b]), int(counter[b])
        run, running, row = 0, True, []
        for i in range(T):
            x = logits[b, i]
            draft = min(max(int(inputs[b][(i + 1) % T]), 0), V - 1)
            has_draft = i < int(drafted[b])
            if t > 0:
                c = candidates(x, t, int(top_k[b]), float(top_p[b]))
                cm = max(c)
                p = math.exp(c[draft] - cm) / sum(math.exp(v - cm) for v in c)
                accept = uniform(key, start + i, V) < p
                own = gumbel_draw(c, key, start + i, draft if has_draft else -1)
            else:
                own = argmax(x.tolist())
                accept = draft == own
            running = running and accept and has_draft
            run += running
            row.append((draft, own))
        tokens = [draft if i < run else own for i, (draft, own) in enumerate(row)]
        lps = [log_softmax(logits[b, i].tolist()) for i in range(T)]
        best = [top(logits[b, i].tolist(), top_n) for i in range(T)]
        out[0].append(tokens), out[1].append(run), out[2].append([lp[tok] for lp, tok in zip(lps, tokens)])
        out[3].append(best), out[4].append([[lp[i] for i in ids] for lp, ids in zip(lps, best)])
    return out


def row_params(B: int, g: torch.Generator):
    """Per-row sampling parameters: about half the rows greedy, some with top-k, some with top-p."""
    sampled = torch.rand(B, generator=g) < 0.5
    temperature = torch.where(sampled, torch.rand(B, generator=g) * 1.5 + 0.2, torch.zeros(B))
    top_k = torch.where(torch.rand(B, generator=g) < 0.3, torch.randint(1, 9, (B,), generator=g), 0)
    top_p = torch.where(torch.rand(B, generator=g) < 0.3, torch.rand(B, generator=g) * 0.8 + 0.1, torch.ones(B))
    return (temperature, top_k, top_p, torch.randint(0, 2**32, (B,), generator=g),
            torch.randint(0, 10**6, (B,), generator=g))


def mismatches(seed: int = 0) -> list[str]:
    """Every case where an op's tokens, accepted counts or top ids differ from the loops, or a logprob by
    more than 1e-5; [] when none do. Vocabularies of 1, 7, 40 and 300 (vectors and tails of every build);
    logits with repeated values (ties) and a greedy row with NaNs (torch ranks NaN above every number);
    top_n 0, 3 and past the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    problems = []

    def compare(name, got, want, exact):
        for i, (a, b) in enumerate(zip(got, want)):
            a = a.tolist()
            same = a == b if exact else torch.allclose(torch.tensor(a, dtype=torch.float64),
                                                       torch.tensor(b, dtype=torch.float64), atol=1e-5, equal_nan=True)
            if not same:
                problems.append(f"{name} output {i}: {a} != {b}")

    for V in (1, 7, 40, 300):
        for B in (1, 5):
            for top_n in (0, 3, V + 2):
                logits = torch.randn(B, V, generator=g) * 3
                params = row_params(B, g)
                if V > 4:
                    logits[:, 3] = logits[:, 1]  # a tie, found by the argmax or the top ids when it is the max
                    logits[0, 2] = logits[0].max()
                if V > 20 and B > 1:  # NaNs in a greedy row, one of them past the first vector
                    logits[-1, [5, V - 3]] = math.nan
                    params[0][-1] = 0.0
                got = torch.ops.inkling.sample_tokens(logits, *params, top_n)
                want = sample_rows(logits, *params, min(top_n, V))
                compare(f"sample V={V} B={B} n={top_n}", (got[0], got[2]), (want[0], want[2]), True)
                compare(f"sample V={V} B={B} n={top_n}", (got[1], got[3]), (want[1], want[3]), False)
                for T in (2, 3):
                    logits = torch.randn(B, T, V, generator=g) * 3
                    inputs = torch.randint(0, V + 3, (B, T), generator=g)
                    follow = torch.rand(B, T, generator=g) < 0.7  # drafts that are often the argmax
                    inputs[:, 1:] = torch.where(follow[:, 1:], logits.argmax(-1)[:, :-1], inputs[:, 1:])
                    drafted = torch.randint(0, T, (B,), generator=g)
                    params = row_params(B, g)
                    if V > 20 and B > 1:
                        logits[-1, -1, [V - 2, 7]] = math.nan
                        params[0][-1] = 0.0
                    got = torch.ops.inkling.verify_tokens(logits, inputs, drafted, *params, top_n)
                    want = verify_rows(logits, inputs, drafted, *params, min(top_n, V))
                    name = f"verify V={V} B={B} T={T} n={top_n}"
                    compare(name, (got[0], got[1], got[3]), (want[0], want[1], want[3]), True)
                    compare(name, (got[2], got[4]), (want[2], want[4]), False)
    return problems

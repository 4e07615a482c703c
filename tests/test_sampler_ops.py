"""The samplers as ops (`inkling::sample_tokens`, `inkling::verify_tokens`): every instruction-set build of
the C++ kernel against plain loops (`sampler_oracle.py`), the torch references against the same loops, the
op against its reference on the engine's own shapes, and the compiled CPU steps calling the ops."""

import pytest
import torch

from forced_build import run_in_build
from inkling_compiled.custom_ops import KERNELS, native_kernels
from sampler_oracle import mismatches, row_params, sample_rows, verify_rows

ORACLE_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from inkling_compiled.custom_ops.library import cpu_isa, native_kernels
from sampler_oracle import mismatches
native_kernels()
problems = mismatches()
print(cpu_isa(), len(problems), *problems[:3])
"""


@pytest.mark.parametrize("isa", ["native", "avx2", "portable"])
def test_every_build_of_the_sampler_kernels_matches_the_plain_loops(isa):
    """Greedy and sampled rows, top-k and top-p, ties, vocabularies shorter than a vector, top_n 0 and past
    the vocabulary; verify rows with and without real drafts, drafts past the vocabulary."""
    if isa == "native":
        assert native_kernels()
        problems = mismatches()
        assert problems == []
    else:
        import pathlib

        count, *problems = run_in_build(isa, ORACLE_SCRIPT.format(tests=str(pathlib.Path(__file__).parent)))[0].split()
        assert count == "0", problems


@pytest.mark.parametrize("op", ["sample_tokens", "verify_tokens"])
def test_the_torch_references_match_the_plain_loops(op):
    """What a GPU step runs (the ops' torch math) is the same sampler."""
    g = torch.Generator().manual_seed(7)
    B, T, V, top_n = 4, 3, 50, 5
    params = row_params(B, g)
    if op == "sample_tokens":
        logits = torch.randn(B, V, generator=g) * 3
        got = KERNELS[op]["reference"](logits, *params, top_n)
        want = sample_rows(logits, *params, top_n)
        exact, close = (0, 2), (1, 3)
    else:
        logits = torch.randn(B, T, V, generator=g) * 3
        inputs = torch.cat([torch.randint(0, V, (B, 1), generator=g), logits.argmax(-1)[:, :-1]], dim=1)
        drafted = torch.tensor([2, 1, 0, 2])
        got = KERNELS[op]["reference"](logits, inputs, drafted, *params, top_n)
        want = verify_rows(logits, inputs, drafted, *params, top_n)
        exact, close = (0, 1, 3), (2, 4)
    for i in exact:
        assert got[i].tolist() == want[i]
    for i in close:
        assert torch.allclose(got[i].double(), torch.tensor(want[i], dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("rows", [1, 8, 24])
def test_the_kernels_match_their_references_on_the_engines_shapes(rows):
    """The shipped checkpoint's vocabulary (2,000, not a multiple of a vector), 20 top logprobs, as a decode
    step of `rows` rows and a verify step of rows / 1 x 3 positions."""
    g = torch.Generator().manual_seed(rows)
    V, top_n = 2000, 20
    params = row_params(rows, g)
    logits = torch.randn(rows, V, generator=g) * 4
    got = torch.ops.inkling.sample_tokens(logits, *params, top_n)
    want = KERNELS["sample_tokens"]["reference"](logits, *params, top_n)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert torch.allclose(got[1], want[1], atol=1e-5) and torch.allclose(got[3], want[3], atol=1e-5)
    logits = torch.randn(rows, 3, V, generator=g) * 4
    inputs = torch.cat([torch.randint(0, V, (rows, 1), generator=g), logits.argmax(-1)[:, :-1]], dim=1)
    drafted = torch.randint(0, 3, (rows,), generator=g)
    got = torch.ops.inkling.verify_tokens(logits, inputs, drafted, *params, top_n)
    want = KERNELS["verify_tokens"]["reference"](logits, inputs, drafted, *params, top_n)
    for i in (0, 1, 3):
        assert torch.equal(got[i], want[i])
    for i in (2, 4):
        assert torch.allclose(got[i], want[i], atol=1e-5)


def test_the_ops_refuse_what_they_cannot_sample():
    params = row_params(2, torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="fp32 logits of 2 dimensions"):
        torch.ops.inkling.sample_tokens(torch.randn(2, 5, dtype=torch.float64), *params, 3)
    with pytest.raises(RuntimeError, match="one sampling parameter per row"):
        torch.ops.inkling.sample_tokens(torch.randn(3, 5), *params, 3)
    with pytest.raises(RuntimeError, match=r"inputs \[B, T\] and drafted \[B\]"):
        torch.ops.inkling.verify_tokens(torch.randn(2, 3, 5), torch.zeros(2, 2, dtype=torch.long),
                                        torch.zeros(2, dtype=torch.long), *params, 3)


def test_opcheck_of_both_samplers():
    params = row_params(3, torch.Generator().manual_seed(3))
    torch.library.opcheck(torch.ops.inkling.sample_tokens.default, (torch.randn(3, 10), *params, 4))
    torch.library.opcheck(torch.ops.inkling.verify_tokens.default,
                          (torch.randn(3, 2, 10), torch.randint(0, 10, (3, 2)), torch.tensor([1, 0, 1]), *params, 4))

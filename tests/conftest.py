import os

# Before torch loads: one OpenMP thread (the second core of CI machines is noisy), a project-local
# inductor cache, and NVTX off.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.realpath(os.path.join(os.path.dirname(__file__), "..", ".cache", "inductor")))
os.environ.setdefault("NVTX_DISABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
# Without a GPU the Triton (CUDA) kernels run under Triton's interpreter, on CPU tensors. Read when a
# kernel module is first imported, which is never before a test asks for one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from inkling_compiled.spec import Drafter  # noqa: E402
from inkling_compiled.tiny import build_tiny_checkpoint  # noqa: E402

PARITY_CONFIGS = ["tiny", "tiny-k3"]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def inductor_cache_stays_put():
    """Inductor has one cache per process, read from TORCHINDUCTOR_CACHE_DIR at each compile, and an engine
    given `compile_cache_dir` points it there for good. A test that does so without restoring it would
    leave every later test compiling into a fresh cache: cold, and sharing no saved step with the rest."""
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    yield
    after = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if after != before:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        if before is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before
        pytest.fail(f"the test left TORCHINDUCTOR_CACHE_DIR at {after} (it was {before}): set it with "
                    "monkeypatch.setenv before the engine does, so that it is restored")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name, layout=..., shards=...) -> folder, built once per session."""
    built = {}

    def get(name="tiny", layout="transformers", shards=1):
        key = (name, layout, shards)
        if key not in built:
            built[key] = build_tiny_checkpoint(tmp_path_factory.mktemp(f"{name}-{layout}-{shards}"), name,
                                               layout=layout, shards=shards)
        return built[key]

    return get


@pytest.fixture(scope="session")
def hf_model(checkpoint):
    """transformers' InklingForCausalLM on the same tiny checkpoint (fp32, eval), cached per config."""
    transformers = pytest.importorskip("transformers")
    models = {}

    def get(name="tiny"):
        if name not in models:
            m = transformers.InklingForCausalLM.from_pretrained(checkpoint(name), dtype=torch.float32)
            m.generation_config.eos_token_id = None
            models[name] = m.eval()
        return models[name]

    return get


class Threes(Drafter):
    """Always a guess (K threes): every decode step of an engine drafting with it verifies."""

    def propose(self, reqs):
        return [[3] * self.num_tokens for _ in reqs]


def checkpoint_named(model) -> dict[str, torch.Tensor]:
    """A loaded model's parameters under the checkpoint's names: each stacked projection cut back into
    its parts (q, k, v, r by the attention's widths; gate and up in halves)."""
    from inkling_compiled.model import FUSED_PROJECTIONS

    out = {}
    for name, p in model.named_parameters():
        weight = name.removesuffix("_scale")
        fused = next((f for f in FUSED_PROJECTIONS if weight.endswith("." + f)), None)
        if fused is None:
            out[name] = p
            continue
        dim, parts = FUSED_PROJECTIONS[fused]
        prefix = weight[:-len(fused)]
        owner = model.get_submodule(prefix + fused.split(".")[0]) if fused.startswith("self_attn.") else None
        sizes = owner.widths if owner is not None else [p.shape[dim] // 2] * 2
        for part, piece in zip(parts, p.split(list(sizes), dim=dim)):
            out[prefix + part + name[len(weight):]] = piece
    return out


def has_symbolic_batch(gm) -> bool:
    """Whether a recorded step graph's metadata inputs all have a symbolic leading (batch) dimension."""
    sizes = [n.meta["example_value"].shape[0] for n in gm.graph.find_nodes(op="placeholder")
             if "metadata" in n.name and isinstance(n.meta.get("example_value"), torch.Tensor)]
    assert sizes
    return all(isinstance(s, torch.SymInt) for s in sizes)


def random_prompt(length, seed, low=3, high=259):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (length,), generator=g).tolist()


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """hf_greedy(name, prompt, n) -> (tokens, logprobs of those tokens): transformers batch-1, unpadded."""
    cache = {}

    def get(name, prompt, n):
        key = (name, tuple(prompt), n)
        if key not in cache:
            out = hf_model(name).generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                          eos_token_id=None, output_logits=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(prompt):]
            logits = torch.stack(out.logits, 1)[0].float()
            logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
            cache[key] = (tokens.tolist(), logprobs)
        return cache[key]

    return get


PARITY_LENGTHS = [1, 2, 3, 5, 8, 13, 21, 34, 55, 80]


def count_guard_checks(monkeypatch) -> list:
    """A list that gains an entry at every check of a compiled step's Dynamo guards from now on."""
    checks = []
    wrapper = torch._dynamo.guards.GuardManagerWrapper
    real_check = wrapper.check
    monkeypatch.setattr(wrapper, "check", lambda self, f_locals: checks.append(1) or real_check(self, f_locals))
    return checks

"""Speculative decoding on CUDA, every method: greedy output with speculation equals the same
engine's output without it (and transformers'), on a tiny fp32 Llama with drafters saved as
checkpoints (tests/support/spec_heads.py), with the runner's CUDA graphs captured as the worker
captures them (steps without drafts replay the decode graphs, steps that verify drafts the verify
graphs of accel/verify_graphs.py; EAGLE-3's target returns its auxiliary layer states from the
graphs too; the DFlash draft's block forward runs the paged kernel non-causally). The drafters'
own steps replay graphs too (accel/draft_graphs.py: a feature head's whole draft loop, a draft
model's after its first draw, the DFlash block forward) and propose what the eager loop does.
The draft loop never synchronizes with the GPU: it runs under torch.cuda.set_sync_debug_mode
(the drafts are read back once, after the loop)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from services.worker.spec import SpeculativeConfig
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.host_sync import guarded
from tests.support.spec_heads import (
    write_dflash_draft,
    write_eagle3_head,
    write_eagle_head,
    write_mtp_target,
)
from tests.support.tiny_llama import make_tiny_llama, reference_greedy

pytestmark = pytest.mark.timeout(900)

PROMPTS = {"a": [5, 17, 99, 3, 250, 41], "b": [7, 7, 300, 12], "c": list(range(20, 45))}
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, seed=4, max_tokens=NEW_TOKENS, ignore_eos=True)
SYNC_WARNING = "called a synchronizing CUDA operation"
#: label -> (SPEC_METHOD, drafter dir, served target dir)
METHODS = {
    "ngram": ("ngram", "", "target"),
    "draft": ("draft", "draft", "target"),
    "eagle": ("eagle", "eagle", "target"),
    "eagle3": ("eagle3", "eagle3", "target"),
    "eagle3-speculators": ("eagle3", "eagle3s", "target"),
    "mtp": ("mtp", "mtp", "mtp"),
    "dflash": ("dflash", "dflash", "target"),
}
#: the methods whose draft loop is captured (accel/draft_graphs.py): a draft model, feature
#: heads, the DFlash draft's block forward
CAPTURED_LOOPS = ["draft", "eagle", "eagle3", "eagle3-speculators", "mtp", "dflash"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("spec_cuda")
    target = root / "target"
    hf = make_tiny_llama(target, seed=0)
    make_tiny_llama(root / "draft", seed=1, num_hidden_layers=1)
    write_eagle_head(target, root / "eagle", identity=True)
    write_eagle3_head(target, root / "eagle3", draft_vocab_size=128, identity=True)
    write_eagle3_head(target, root / "eagle3s", speculators=True, identity=True)
    write_mtp_target(target, root / "mtp", identity=True)
    write_dflash_draft(target, root / "dflash", block_size=8)  # K 3: the block is wider
    reference = {rid: reference_greedy(hf, p, NEW_TOKENS) for rid, p in PROMPTS.items()}
    return root, reference


def cuda_engine(root: Path, label: str | None) -> InProcessEngine:
    spec = None
    target = root / "target"
    if label is not None:
        method, drafter, served = METHODS[label]
        target = root / served
        model = str(root / drafter) if drafter else ""
        spec = SpeculativeConfig(method=method, model=model, num_spec_tokens=3)
    engine = InProcessEngine(target, device="cuda", speculative=spec, num_blocks=256)
    engine.runner.warmup()  # as the worker starts: warm-up, then the decode graphs
    engine.runner.capture_cuda_graphs()
    return engine


@pytest.mark.parametrize("label", list(METHODS))
def test_greedy_with_speculation_equals_without_on_cuda(root, label: str) -> None:
    path, reference = root
    plain = cuda_engine(path, None).generate(PROMPTS, GREEDY)
    assert {rid: g.token_ids for rid, g in plain.items()} == reference
    engine = cuda_engine(path, label)
    out = engine.generate(PROMPTS, GREEDY)
    assert {rid: g.token_ids for rid, g in out.items()} == reference
    assert engine.scheduler.spec.stats.num_draft_tokens > 0
    verify = engine.runner.verify_graphs
    assert verify is not None and verify.replays  # steps with drafts replayed a graph
    assert max(verify.replays) <= 4  # the smallest graph holding the step: 3 prompts or fewer
    drafter = engine.runner.drafter
    inner = drafter.features or drafter.draft_model  # type: ignore[union-attr]
    if label in CAPTURED_LOOPS:  # their draft loop replayed its graphs (accel/draft_graphs.py)
        assert inner.graphs is not None and sum(inner.graphs.replays.values()) > 0


@pytest.mark.parametrize("label", CAPTURED_LOOPS)
def test_the_captured_draft_loop_proposes_what_the_eager_loop_does(root, label: str) -> None:
    """Seeded sampled requests (drafts drawn with temperature, q kept for rejection sampling)
    give the same tokens, drafts and acceptances whether the head's draft loop replays its
    CUDA graphs or runs eagerly."""
    path, _ = root
    runs = []
    for captured in (True, False):
        engine = cuda_engine(path, label)
        drafter = engine.runner.drafter
        inner = drafter.features or drafter.draft_model  # type: ignore[union-attr]
        if not captured:
            inner.graphs = None
            if hasattr(inner, "observe_graphs"):  # a feature head's observe too
                inner.observe_graphs = None
        out = engine.generate(PROMPTS, SAMPLED)
        stats = engine.scheduler.spec.stats
        runs.append(
            (
                {rid: g.token_ids for rid, g in out.items()},
                stats.num_draft_tokens,
                stats.num_accepted_tokens,
            )
        )
        if captured:
            assert sum(inner.graphs.replays.values()) > 0
            if hasattr(inner, "observe_graphs"):
                assert sum(inner.observe_graphs.replays.values()) > 0
    assert runs[0] == runs[1]
    assert runs[0][1] > 0


@pytest.mark.parametrize("label", [m for m in METHODS if m != "ngram"])
def test_the_draft_loop_never_synchronizes(root, label: str) -> None:
    path, _ = root
    engine = cuda_engine(path, label)
    drafter = engine.runner.drafter
    assert drafter is not None
    inner = drafter.features or drafter.draft_model
    assert inner is not None
    sites: list[str] = []

    def guard(call):  # type: ignore[no-untyped-def]
        def guarded(*args):  # type: ignore[no-untyped-def]
            def record(message, category, filename, lineno, file=None, line=None) -> None:  # type: ignore[no-untyped-def]
                if SYNC_WARNING in str(message):
                    sites.append(f"{Path(filename).name}:{lineno}")

            with warnings.catch_warnings():
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                warnings.showwarning = record
                try:
                    return call(*args)
                finally:
                    torch.cuda.set_sync_debug_mode("default")

        return guarded

    inner.propose = guard(inner.propose)  # type: ignore[method-assign]
    observe = getattr(inner, "observe_graphs", None)  # a feature head's captured observe
    if observe is not None:
        observe.run = guard(observe.run)  # type: ignore[method-assign]
    out = engine.generate(PROMPTS, SAMPLED)  # sampled drafts: q kept on the device too
    assert all(len(g.token_ids) == NEW_TOKENS for g in out.values())
    assert engine.scheduler.spec.stats.num_draft_tokens > 0
    assert not sites, f"the draft loop synchronized at {sorted(set(sites))}"
    if observe is not None:
        assert sum(observe.replays.values()) > 0


def chained_engine(root: Path) -> InProcessEngine:
    """n-gram verify steps chained on the device (services/worker/spec/chain.py), planned
    ahead as the mesh plans them, the verify graphs captured."""
    engine = InProcessEngine(
        root / "target",
        device="cuda",
        speculative=SpeculativeConfig(method="ngram", num_spec_tokens=3),
        num_blocks=256,
        scheduler_options={"spec_drafts_on_worker": True},
        runner_options={"device_chain": True},
    )
    engine.runner.warmup()
    engine.runner.capture_cuda_graphs()
    return engine


#: prompts and lengths where the tiny model's outputs repeat themselves: drafts get accepted
LOOPING = {**PROMPTS, "d": [5, 6, 7, 8] * 5, "e": [9, 10, 11] * 6 + [9]}
LONG_GREEDY = GREEDY.model_copy(update={"max_tokens": 48})
LONG_SAMPLED = SamplingParams(temperature=0.3, seed=4, max_tokens=48, ignore_eos=True)


def test_chained_verify_steps_on_cuda(root) -> None:
    """Greedy and seeded sampling: the plain engine's tokens (the first test holds those to
    transformers'). The steps launch one behind another without the host ever waiting for the
    GPU (set_sync_debug_mode), drafts accepted on the device: whole steps replayed from the
    chained graphs (accel/chain_graphs.py), or, with top-k (a draw those graphs do not hold),
    the layout kernel, the verify graph and the acceptance kernel one by one."""
    path, _ = root
    top_k = LONG_SAMPLED.model_copy(update={"top_k": 20})
    for params in (LONG_GREEDY, LONG_SAMPLED, top_k):
        plain = cuda_engine(path, None).generate(LOOPING, params)
        engine = chained_engine(path)
        sites: list[str] = []
        engine.runner.launch = guarded(engine.runner.launch, sites)  # type: ignore[method-assign]
        out = engine.generate(LOOPING, params, overlap=True, ahead=3)
        assert {r: g.token_ids for r, g in out.items()} == {
            r: g.token_ids for r, g in plain.items()
        }
        assert engine.launched_ahead > 0
        assert engine.scheduler.spec.stats.num_accepted_tokens > 0
        whole, verify = engine.runner.chain_graphs, engine.runner.verify_graphs
        assert whole is not None and verify is not None
        assert (sum(whole.replays.values()) > 0) == (params is not top_k)
        assert (sum(verify.replays.values()) > 0) == (params is top_k)
        assert not sites, f"a chained launch synchronized at {sorted(set(sites))}"

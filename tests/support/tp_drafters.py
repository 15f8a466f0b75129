"""What one rank of a tensor-parallel group generates with each model drafter (a draft model,
EAGLE-1/2, EAGLE-3 with its own smaller vocabulary, MTP modules in the target's checkpoint, a
DFlash draft):
greedy and seeded outputs through the scheduler core and the rank's runner, and the drafts the
scheduler saw verified. Run on every rank by tests/support/tp_ranks.py, and in-process at TP=1,
so the tests compare the group's drafting with TP=1's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from services.worker.loader import load_model
from services.worker.parallel.group import TensorParallel
from services.worker.spec import SpeculativeConfig
from shared.protocol import SamplingParams
from tests.support.engine import InProcessEngine
from tests.support.spec_heads import (
    write_dflash_draft,
    write_eagle3_head,
    write_eagle_truncated_target,
    write_mtp_truncated_target,
    write_truncated_model,
)
from tests.support.tiny_llama import make_tiny_llama

PROMPTS = {"a": [5, 17, 99, 3, 250, 41], "b": [7, 7, 300, 12], "c": list(range(20, 45))}
NEW_TOKENS = 12
K = 3
#: method -> (drafter dir, target dir to serve), under the checkpoints' root
DRAFTERS = {
    "draft": ("draft", "target"),
    "eagle": ("eagle", "target"),
    "eagle3": ("eagle3", "target"),
    "mtp": ("mtp", "mtp"),
    "dflash": ("dflash", "target"),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=NEW_TOKENS, ignore_eos=True)


def write_checkpoints(root: Path) -> Any:
    """The target and every drafter; returns the target as transformers holds it.

    The target is a tiny Llama whose 509-token vocabulary does not split evenly (so the
    vocab-parallel embedding and LM head the heads share are padded), with its layers after the
    first damped: drafters made of its first layer (a draft model, an EAGLE head, an MTP
    module) then predict some of its tokens and miss others. The EAGLE-3 head passes the
    deepest auxiliary stream through (its drafts repeat the last token: accepted now and then
    when sampled)."""
    target = root / "target"
    hf = make_tiny_llama(target, seed=0, vocab_size=509)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
    hf.save_pretrained(target)
    write_truncated_model(target, root / "draft", num_layers=1)
    write_eagle_truncated_target(target, root / "eagle")
    write_eagle3_head(target, root / "eagle3", draft_vocab_size=127, identity=True)
    write_mtp_truncated_target(target, root / "mtp")
    write_dflash_draft(target, root / "dflash", block_size=8)  # K 4 at the worker's default
    return hf


def _run(
    tp: TensorParallel, root: Path, method: str, prompts: dict[str, SamplingParams]
) -> dict[str, Any]:
    drafter, target = DRAFTERS[method]
    spec = SpeculativeConfig(method=method, model=str(root / drafter), num_spec_tokens=K)
    engine = InProcessEngine(
        root / target,
        model_and_config=load_model(root / target, torch.float32, "cpu", tp=tp),
        speculative=spec,
        num_blocks=96,
    )
    for rid, params in prompts.items():
        engine.submit(rid, PROMPTS[rid], params)
    generated = engine.run()
    stats = engine.scheduler.spec.stats
    return {
        "outputs": {rid: gen.token_ids for rid, gen in generated.items()},
        "drafted": stats.num_draft_tokens,
        "accepted": stats.num_accepted_tokens,
        "steps": engine.steps,
    }


def drafter_runs(tp: TensorParallel, root: str, methods: list[str]) -> dict[str, Any]:
    """method -> {"greedy": run, "seeded": run}; "plain": greedy without speculation."""
    path = Path(root)
    plain = InProcessEngine(
        path / "target",
        model_and_config=load_model(path / "target", torch.float32, "cpu", tp=tp),
        num_blocks=96,
    ).generate(PROMPTS, GREEDY)
    out: dict[str, Any] = {"plain": {rid: gen.token_ids for rid, gen in plain.items()}}
    for method in methods:
        out[method] = {
            "greedy": _run(tp, path, method, dict.fromkeys(PROMPTS, GREEDY)),
            "seeded": _run(tp, path, method, {rid: seeded(7 + i) for i, rid in enumerate(PROMPTS)}),
        }
    return out


def built_drafters(tp: TensorParallel, root: str, methods: list[str]) -> dict[str, Any]:
    """method -> (the target's q/k/v rows, {drafter parameter: (shape, sum of |values|)}) of
    the runner the worker builds from its settings on this rank (bootstrap.build_runner: MTP
    finds its modules in the served checkpoint, as MESHLLM_SPEC_MODEL unset)."""
    from services.worker.runner.bootstrap import build_runner
    from shared.config import WorkerSettings
    from shared.model.source import ModelSource

    out: dict[str, Any] = {}
    for method in methods:
        drafter, target = DRAFTERS[method]
        path = Path(root) / target
        settings = WorkerSettings(
            tp=tp.size,
            device="cpu",
            dtype="float32",
            max_model_len=64,
            kv_cache_bytes=2**20,
            spec_method=method,  # type: ignore[arg-type]
            spec_model="" if method == "mtp" else str(Path(root) / drafter),
        )
        runner, _ = build_runner(ModelSource("tiny", path, path), settings, "inc", tp)
        assert runner.drafter is not None
        spec = runner.drafter.draft_model or runner.drafter.features
        module = spec.model if method == "draft" else spec.head  # type: ignore[union-attr]
        params = {
            name: (tuple(p.shape), float(p.abs().sum())) for name, p in module.named_parameters()
        }
        out[method] = (runner.model.layers[0].self_attn.qkv_proj.out_features, params)
    return out

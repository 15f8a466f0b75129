"""A model drafter's own steps from CUDA graphs against the same steps run eagerly
(services/worker/accel/draft_graphs.py), SmolLM2 in bf16 on CUDA, in process (scheduler core +
model runner, bench.spec_ngram.Engine, set up as the worker: warm-up, decode/verify/draft
graphs).

Per method (an EAGLE-3 head and a DFlash draft, random weights written in their users' formats,
so few drafts are accepted: the verify steps are the same in both runs and what differs is the
proposal), one engine runs the copy tasks of bench.spec_ngram greedy, alternating a run with
its draft loop replaying graphs and a run with it eager (the drafter's `graphs` unset), both
warmed by a first untimed pair; every output is checked equal across the two. Reported: output
tokens/s of each, their ratio (median of the per-pair ratios), the host ms of one proposal
(the drafter's `propose`, launches only: nothing waits for the device in either path), and the
mean tokens per verify step.

    python -m bench.gpu.draft_loop --model PATH [--k 4] [--batch 1 16] [--max-tokens 128]
                                   [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.spec_ngram import TASKS, Engine
from services.worker.loader import load_model
from services.worker.spec import SpeculativeConfig
from services.worker.spec.dflash import random_dflash_head, save_dflash_head
from services.worker.spec.eagle3 import random_eagle3_head, save_eagle3_head
from shared.config import ModelSettings
from shared.model.source import resolve_model
from shared.protocol import SamplingParams


def write_drafters(hf_dir: Path, root: Path, k: int) -> dict[str, Path]:
    """A random EAGLE-3 head (EAGLE/vLLM layout, the target's vocabulary) and a random
    one-layer DFlash draft (z-lab's layout, a block of K + 1), shaped for the target."""
    hf = json.loads((hf_dir / "config.json").read_text())
    layers = int(hf["num_hidden_layers"])
    layer_hf = {**hf, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}
    eagle3 = random_eagle3_head(
        layer_hf, num_target_layers=layers, draft_vocab_size=int(hf["vocab_size"]),
        max_model_len=4096,
    )  # fmt: skip
    save_eagle3_head(eagle3, root / "eagle3")
    dflash = random_dflash_head(
        {**hf, "num_hidden_layers": 1}, num_target_layers=layers, block_size=k + 1,
        mask_token_id=int(hf["vocab_size"]) - 1, max_model_len=4096,
    )  # fmt: skip
    save_dflash_head(dflash, root / "dflash", num_target_layers=layers)
    return {"eagle3": root / "eagle3", "dflash": root / "dflash"}


class ProposalClock:
    """Host seconds of each `propose` call of a drafter (wrapped in place)."""

    def __init__(self, inner: Any) -> None:
        self.seconds: list[float] = []
        wrapped = inner.propose

        def propose(batch: Any, draws: Any) -> None:
            started = time.perf_counter()
            wrapped(batch, draws)
            self.seconds.append(time.perf_counter() - started)

        inner.propose = propose

    def take_ms(self) -> float:
        ms = statistics.median(self.seconds) * 1000.0 if self.seconds else 0.0
        self.seconds.clear()
        return round(ms, 3)


def run_method(
    model: Any, config: Any, method: str, path: Path, args: argparse.Namespace, batch: int
) -> dict[str, Any]:
    spec = SpeculativeConfig(method=method, model=str(path), num_spec_tokens=args.k)
    engine = Engine(model, config, spec, device="cuda")
    drafter = engine.runner.drafter
    assert drafter is not None
    inner = drafter.features
    graphs = inner.graphs  # type: ignore[union-attr]
    assert graphs is not None, "the draft loop was not captured"
    clock = ProposalClock(inner)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.hf_dir)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    out: dict[str, Any] = {}
    for task, text in TASKS.items():
        chats = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"({i + 1}) {text}"}],
                add_generation_prompt=True,
                tokenize=False,
            )
            for i in range(batch)
        ]
        prompts = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in chats]
        rows: dict[str, list[float]] = {"graphs": [], "eager": [], "propose_graphs_ms": [],
                                        "propose_eager_ms": []}  # fmt: skip
        same = True
        tokens_per_verify: list[float] = []
        for repeat in range(args.repeats + 1):  # the first pair warms both paths
            outputs = {}
            for label in ("graphs", "eager"):
                inner.graphs = graphs if label == "graphs" else None  # type: ignore[union-attr]
                engine.step_ms["verify"].clear()
                started = time.perf_counter()
                result, _ = engine.generate(prompts, params)
                seconds = time.perf_counter() - started
                outputs[label] = result
                propose_ms = clock.take_ms()
                if repeat:
                    rows[label].append(sum(len(r) for r in result) / seconds)
                    rows[f"propose_{label}_ms"].append(propose_ms)
            same = same and outputs["graphs"] == outputs["eager"]
            stats = engine.scheduler.spec.stats
            if stats.num_drafts:
                tokens_per_verify.append(1 + stats.num_accepted_tokens / stats.num_drafts)
        ratios = [g / e for g, e in zip(rows["graphs"], rows["eager"], strict=True)]
        out[task] = {
            "tok_s_graphs": round(max(rows["graphs"]), 1),
            "tok_s_eager": round(max(rows["eager"]), 1),
            "graphs_over_eager": round(statistics.median(ratios), 3),
            "propose_ms_graphs": statistics.median(rows["propose_graphs_ms"]),
            "propose_ms_eager": statistics.median(rows["propose_eager_ms"]),
            "tokens_per_verify": round(tokens_per_verify[-1], 3) if tokens_per_verify else None,
            "same_tokens": same,
        }
    inner.graphs = graphs  # type: ignore[union-attr]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    source = resolve_model(args.model, ModelSettings().model_cache_dir)
    args.hf_dir = source.hf_dir
    model, config = load_model(source.hf_dir, torch.bfloat16, "cuda")
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "k": args.k}
    with tempfile.TemporaryDirectory() as tmp:
        drafters = write_drafters(Path(source.hf_dir), Path(tmp), args.k)
        for method, path in drafters.items():
            for batch in args.batch:
                results[f"{method}_b{batch}"] = run_method(model, config, method, path, args, batch)
                print(method, batch, json.dumps(results[f"{method}_b{batch}"]), flush=True)
    text = json.dumps(results, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()

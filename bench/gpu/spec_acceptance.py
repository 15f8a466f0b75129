"""Acceptance per draft position of every speculative method on the real SmolLM2 weights, with
heads trained here: no EAGLE, EAGLE-3, MTP or DFlash checkpoint (nor a smaller draft model)
exists for SmolLM2-135M, and random heads accept almost nothing.

1. Data: the target (transformers, bf16) answers chat prompts built from templates and words
   of its vocabulary, half greedy and half sampled (T 0.8): its own text, as EAGLE trains.
2. Training (bench/head_training.py, the heads' serving modules over dense batches, one target
   forward a step for all of them, for --train-seconds): an EAGLE-1/2 head (one layer, the
   target's LM head), an EAGLE-3 head (speculators' layout, a draft vocabulary of the
   --draft-vocab most frequent tokens with d2t), an MTP module appended to a copy of the
   target's checkpoint (DeepSeek-V3's spelling), a two-layer DFlash draft (block --block) and
   a draft model of the target's first --draft-layers layers. Each is written in its users'
   format and served from disk.
3. Per method (and n-gram, and no speculation), in process (bench.spec_ngram.Engine, set up as
   the worker: decode/verify/draft graphs), greedy, K drafts: held-out chat prompts and the
   edit-a-snippet copy task, at each --batch; one untimed warm-up run, then the best of
   --repeats. Reported: acceptance per position (vLLM's `num_accepted_tokens_per_pos` /
   `num_drafts`), mean accepted length, output tok/s and the ratio to no speculation measured
   the same way, the median wall / device ms of the decode and verify steps, and per method
   the median ms between the runner's host marks of those steps (over every run).
   `--eager-observe` also runs each feature head (EAGLE, EAGLE-3, MTP) and the DFlash draft
   with its `observe` eager instead of replaying its graphs (accel/observe_graphs.py),
   reported as METHOD_eager_observe.

    python -m bench.gpu.spec_acceptance --model PATH [--k 3] [--batch 1 16] [--train-seconds 150]
                                        [--eager-observe] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.head_training import (
    DFlashTrainer,
    DraftModelTrainer,
    FeatureHeadTrainer,
    batches,
    train,
)
from bench.spec_ngram import TASKS, Engine
from services.worker.loader import load_model
from services.worker.models.llama import LlamaDecoderLayer
from services.worker.models.random_init import init_random_
from services.worker.spec import SpeculativeConfig
from services.worker.spec.dflash import random_dflash_head, save_dflash_head
from services.worker.spec.eagle import random_eagle_head, save_eagle_head
from services.worker.spec.eagle3 import random_eagle3_head, save_eagle3_head
from services.worker.spec.mtp import MtpHead, append_mtp_modules, mtp_tensors
from shared.config import ModelSettings
from shared.model.source import resolve_model
from shared.protocol import SamplingParams

TEMPLATES = (
    "Write a short paragraph about {a}.",
    "Explain what {a} means to a child.",
    "Write a Python function that works with {a} and {b}, with a docstring.",
    "Tell me a short story about {a} and {b}.",
    "List five facts about {a}.",
    "Compare {a} and {b} in a few sentences.",
    "Write an email to a friend about {a}.",
    "Give three tips for someone learning about {a}.",
    "Summarise why {a} matters, in two sentences.",
    "Write a haiku about {a}, then explain it.",
    "How do I use {a} with {b}? Answer step by step.",
    "Describe a day in the life of someone who loves {a}.",
)


def vocabulary_words(tokenizer: Any, count: int, seed: int) -> list[str]:
    """Whole-word tokens of the vocabulary (a leading space, letters only, 5+ letters)."""
    words = sorted(
        {
            t[1:]
            for t in tokenizer.get_vocab()
            if t.startswith("\u0120") and t[1:].isalpha() and t[1:].islower() and len(t) > 5
        }
    )
    rng = np.random.default_rng(seed)
    return [str(w) for w in rng.choice(words, size=min(count, len(words)), replace=False)]


def chat_prompts(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    words = vocabulary_words(tokenizer, 4 * count, seed)
    out = []
    for i in range(count):
        text = TEMPLATES[int(rng.integers(len(TEMPLATES)))].format(
            a=words[(2 * i) % len(words)], b=words[(2 * i + 1) % len(words)]
        )
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer(chat, add_special_tokens=False)["input_ids"])
    return out


def target_text(
    hf_dir: Path, prompts: list[list[int]], new_tokens: int, eos: int, batch: int, device: str
) -> tuple[np.ndarray, np.ndarray]:
    """The target's own answers (transformers generate, bf16): prompt + answer per row,
    right-padded, and their lengths; half the batches greedy, half sampled at T 0.8."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to(device).eval()
    rows: list[list[int]] = []
    for n, i in enumerate(range(0, len(prompts), batch)):
        group = prompts[i : i + batch]
        width = max(map(len, group))
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        sampled = n % 2 == 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                do_sample=sampled,
                temperature=0.8 if sampled else None,
                top_p=None,
                top_k=None,
                pad_token_id=eos,
                eos_token_id=eos,
            )
        for prompt, row in zip(group, out[:, width:].tolist(), strict=True):
            answer = row[: row.index(eos) + 1] if eos in row else row
            rows.append(prompt + answer)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    longest = max(map(len, rows))
    tokens = np.full((len(rows), longest), eos, dtype=np.int64)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    return tokens, np.array([len(r) for r in rows], dtype=np.int64)


def build_trainers(
    hf_dir: Path, target: Any, tokens: np.ndarray, lengths: np.ndarray, args: argparse.Namespace
) -> tuple[dict[str, Any], torch.Tensor]:
    """The heads to train (random init; the draft model from the target's first layers) and
    the EAGLE-3 head's draft vocabulary (target ids, ascending)."""
    from transformers import AutoModelForCausalLM

    hf = json.loads((hf_dir / "config.json").read_text())
    depth = int(hf["num_hidden_layers"])
    layer_hf = {**hf, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}
    vocab = int(hf["vocab_size"])
    counts = np.bincount(
        np.concatenate([t[:n] for t, n in zip(tokens, lengths, strict=True)]), minlength=vocab
    )
    draft_ids = torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[: args.draft_vocab]))
    eagle = random_eagle_head(layer_hf, max_model_len=4096, seed=1)
    eagle3 = random_eagle3_head(
        layer_hf,
        num_target_layers=depth,
        draft_vocab_size=args.draft_vocab,
        max_model_len=4096,
        seed=2,
    )
    mtp = MtpHead(target.config, LlamaDecoderLayer, max_model_len=4096, own_head=False)
    init_random_(mtp, std=0.02, seed=3)
    dflash = random_dflash_head(
        {**hf, "num_hidden_layers": 2},
        num_target_layers=depth,
        block_size=args.block,
        mask_token_id=args.mask_token_id,
        max_model_len=4096,
        seed=4,
    )
    draft = AutoModelForCausalLM.from_pretrained(
        hf_dir, num_hidden_layers=args.draft_layers, dtype=torch.float32
    )
    for module in (eagle, eagle3, mtp, dflash, draft):
        module.to(args.device, torch.float32)
        rotary: Any = getattr(module, "rotary", None)  # the heads' RoPE tables are not buffers
        if rotary is not None:
            rotary.materialize(args.device, torch.float32)
    steps = args.unroll
    trainers = {
        "eagle": FeatureHeadTrainer(module=eagle, steps=steps, regress=True),
        "eagle3": FeatureHeadTrainer(
            module=eagle3,
            steps=steps,
            aux_layers=eagle3.aux_layers,
            draft_ids=draft_ids.to(args.device),
        ),
        "mtp": FeatureHeadTrainer(module=mtp, steps=steps),
        "dflash": DFlashTrainer(
            module=dflash, anchors=8, generator=torch.Generator().manual_seed(0)
        ),
        "draft": DraftModelTrainer(module=draft),
    }
    return trainers, draft_ids


def save_heads(
    trainers: dict[str, Any], draft_ids: torch.Tensor, hf_dir: Path, root: Path, depth: int
) -> dict[str, Path]:
    """Each trained head in its users' format under `root`."""
    paths = {name: root / name for name in trainers}
    save_eagle_head(trainers["eagle"].module.cpu(), paths["eagle"])
    d2t = draft_ids - torch.arange(len(draft_ids))
    save_eagle3_head(trainers["eagle3"].module.cpu(), paths["eagle3"], speculators=True, d2t=d2t)
    append_mtp_modules(mtp_tensors(trainers["mtp"].module.cpu()), hf_dir, paths["mtp"])
    save_dflash_head(trainers["dflash"].module.cpu(), paths["dflash"], num_target_layers=depth)
    trainers["draft"].module.save_pretrained(paths["draft"])
    return paths


def stats_delta(before: Any, after: Any) -> dict[str, Any]:
    drafts = after.num_drafts - before.num_drafts
    per_pos = [
        a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0)
        for i, a in enumerate(after.accepted_per_pos)
    ]
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {
        "acceptance_per_pos": [round(c / drafts, 3) for c in per_pos] if drafts else [],
        "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 1.0,
    }


def measure(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, repeats: int
) -> dict[str, Any]:
    """Best-of-`repeats` output tok/s after one warm-up; acceptance over the timed runs."""
    from copy import deepcopy

    engine.generate(prompts, params)
    stats = getattr(engine.scheduler.spec, "stats", None) if engine.scheduler.spec else None
    before = deepcopy(stats)
    for samples in engine.step_ms.values():
        samples.clear()
    best, outputs = 0.0, None
    for _ in range(repeats):
        started = time.perf_counter()
        outputs, _ = engine.generate(prompts, params)
        best = max(best, sum(map(len, outputs)) / (time.perf_counter() - started))
    out: dict[str, Any] = {"tok_s": round(best, 1)}
    for kind in ("decode", "verify"):  # (wall, device) ms of the timed runs' steps
        if engine.step_ms[kind]:
            wall, device = zip(*engine.step_ms[kind], strict=True)
            out[f"{kind}_step_ms"] = [
                round(float(np.median(wall)), 3),
                round(float(np.median(device)), 3),
            ]
    if stats is not None:
        out |= stats_delta(before, engine.scheduler.spec.stats)
    out["tokens"] = outputs
    return out


def evaluate(
    model: Any,
    config: Any,
    method: str,
    path: Path | None,
    workloads: dict[str, Any],
    args: argparse.Namespace,
    eager_observe: bool = False,
) -> dict[str, Any]:
    spec = None
    if method == "ngram":
        spec = SpeculativeConfig(method="ngram", num_spec_tokens=args.k)
    elif method != "off":
        spec = SpeculativeConfig(method=method, model=str(path), num_spec_tokens=args.k)
    marks = tempfile.TemporaryDirectory()  # the worker's step timeline: where a step's ms go
    engine = Engine(model, config, spec, device=args.device, marks_dir=marks.name)
    if eager_observe:
        engine.runner.drafter.features.observe_graphs = None  # type: ignore[union-attr]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    out: dict[str, Any] = {}
    for name, prompts in workloads.items():
        out[name] = measure(engine, prompts, params, args.repeats)
    out["phases"] = {kind: engine.phase_split(kind) for kind in ("decode", "verify")}
    del engine
    marks.cleanup()
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--unroll", type=int, default=3, help="training steps unrolled")
    parser.add_argument("--block", type=int, default=8, help="the DFlash draft's block size")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument(
        "--mask-token-id",
        type=int,
        default=-1,
        help="the DFlash block's mask token (-1: a special token absent from the data)",
    )
    parser.add_argument("--prompts", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--gen-batch", type=int, default=1024)
    parser.add_argument("--train-seqs", type=int, default=32)
    parser.add_argument("--train-seconds", type=float, default=150.0)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["off", "ngram", "draft", "eagle", "eagle3", "mtp", "dflash"],
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--eager-observe",
        action="store_true",
        help="also run each feature head and DFlash with its observe eager (no graphs)",
    )
    parser.add_argument("--out", default="", help="a directory for spec_acceptance.json")
    args = parser.parse_args()
    out_dir = Path(args.out) if args.out else None
    source = resolve_model(args.model, ModelSettings().model_cache_dir)
    hf_dir = Path(source.hf_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    eos = int(tokenizer.eos_token_id)
    started = time.monotonic()
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "k": args.k,
        "block": args.block,
    }

    def save() -> None:
        text = json.dumps(results, indent=1)
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "spec_acceptance.json").write_text(text)

    tokens, lengths = target_text(
        hf_dir,
        chat_prompts(tokenizer, args.prompts, seed=0),
        args.new_tokens,
        eos,
        args.gen_batch,
        args.device,
    )
    results["data"] = {
        "sequences": len(tokens),
        "tokens": int(lengths.sum()),
        "seconds": round(time.monotonic() - started, 1),
    }
    print("data", results["data"], flush=True)
    if args.mask_token_id < 0:
        seen = set(np.unique(tokens).tolist())
        unused = [i for i in tokenizer.all_special_ids if i not in seen]
        args.mask_token_id = unused[0] if unused else int(tokenizer.vocab_size) - 1
    results["mask_token_id"] = args.mask_token_id
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, config = load_model(hf_dir, dtype, args.device)
    trainers, draft_ids = build_trainers(hf_dir, model, tokens, lengths, args)
    curves = train(
        model,
        trainers,
        batches(tokens, lengths, args.train_seqs, args.device),
        steps=100_000,
        seconds=args.train_seconds,
        lr={"eagle": 1e-3, "eagle3": 1e-3, "mtp": 1e-3, "dflash": 1e-3, "draft": 2e-4},
        log=lambda line: print(line, flush=True),
    )
    results["training"] = {
        name: {
            "steps": len(c),
            "kl_first": round(float(np.mean(c[:20])), 3),
            "kl_last": round(float(np.mean(c[-20:])), 3),
        }
        for name, c in curves.items()
    }
    print("training", results["training"], flush=True)
    save()
    prompts = chat_prompts(tokenizer, max(args.batch), seed=1)  # held out: other words
    edit = TASKS["edit_code"]
    copy_prompts = []
    for i in range(max(args.batch)):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"({i + 1}) {edit}"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        copy_prompts.append(tokenizer(chat, add_special_tokens=False)["input_ids"])
    workloads = {
        f"{kind}_b{b}": (prompts if kind == "chat" else copy_prompts)[:b]
        for kind in ("chat", "edit")
        for b in args.batch
    }
    with tempfile.TemporaryDirectory() as tmp:
        depth = int(config.num_hidden_layers)
        paths = save_heads(trainers, draft_ids, hf_dir, Path(tmp), depth)
        del trainers
        runs = [(m, m, False) for m in args.methods]
        if args.eager_observe:
            heads = [m for m in args.methods if m in ("eagle", "eagle3", "mtp", "dflash")]
            runs += [(f"{m}_eager_observe", m, True) for m in heads]
        for name, method, eager in runs:
            results[name] = evaluate(
                model, config, method, paths.get(method), workloads, args, eager_observe=eager
            )
            summary = {
                w: {k: v for k, v in r.items() if k != "tokens"} if w != "phases" else r
                for w, r in results[name].items()
            }
            print(name, json.dumps(summary), flush=True)
            save()
    plain = results.get("off")
    plain_tokens = {w: row["tokens"] for w, row in (plain or {}).items() if w != "phases"}
    for method, _, _ in runs:
        for workload, row in results[method].items():
            if workload == "phases":
                continue
            tokens_out = row.pop("tokens")
            if plain is not None and method != "off":
                row["speedup"] = round(row["tok_s"] / plain[workload]["tok_s"], 3)
                row["same_tokens_as_off"] = tokens_out == plain_tokens[workload]
    save()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

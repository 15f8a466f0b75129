"""A prefix-heavy multi-turn chat workload for `vllm bench serve --dataset-name custom`.

`--conversations` conversations of `--turns` turns each; conversation c opens with one of
`--system-prompts` long system prompts (about `--system-words` words, shared by every
conversation that uses it), and each turn's prompt is the whole conversation so far: the system
prompt, every earlier user message and assistant reply, then the new user message. Replies are
fixed synthetic text (not the model's own output), so every engine gets the same prompts and
a turn's prompt extends the previous turn's exactly, as a chat client's does. Lines are written
turn by turn (turn 1 of every conversation, then turn 2, ...), the order conversations advance
in; run the benchmark with `--disable-shuffle` to keep it (vLLM's custom dataset reads the
file with pandas: install it beside vLLM).

    python -m bench.multi_turn --out /tmp/mt.jsonl
    vllm bench serve --backend openai --endpoint /v1/completions --dataset-name custom \
        --dataset-path /tmp/mt.jsonl --disable-shuffle --skip-chat-template \
        --custom-output-len -1 --num-prompts 64 --max-concurrency 4 \
        --model M --tokenizer T --base-url URL

What it measures on the mesh: how often a turn lands on the group that holds its conversation
(KV-aware routing) and what that saves in time to first token.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = "river stone lantern orchard harbor meadow signal copper timber canyon glacier prairie"
WORDS += " compass ledger violet ember thistle falcon granite willow beacon quarry saffron"
WORDS += " tundra marble cinder hollow juniper pewter sparrow garnet fennel basalt cobalt"
WORDS += " heron linden"
VOCAB = WORDS.split(" ")


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(words)).capitalize() + "."


def paragraph(rng: random.Random, words: int) -> str:
    out: list[str] = []
    while sum(len(s.split()) for s in out) < words:
        out.append(sentence(rng, rng.randint(6, 14)))
    return " ".join(out)


def conversations(args: argparse.Namespace) -> list[list[str]]:
    """Per conversation, the prompt of each turn."""
    rng = random.Random(args.seed)
    systems = [
        f"System prompt {i}. You are assistant {i}. " + paragraph(rng, args.system_words)
        for i in range(args.system_prompts)
    ]
    out = []
    for c in range(args.conversations):
        history = systems[c % len(systems)] + "\n"
        turns = []
        for t in range(args.turns):
            history += f"User ({c}.{t}): " + paragraph(rng, args.user_words) + "\nAssistant:"
            turns.append(history)
            history += " " + paragraph(rng, args.reply_words) + "\n"
        out.append(turns)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=500)
    parser.add_argument("--user-words", type=int, default=30)
    parser.add_argument("--reply-words", type=int, default=80)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    convs = conversations(args)
    lines = [
        json.dumps({"prompt": convs[c][t], "output_tokens": args.output_tokens})
        for t in range(args.turns)
        for c in range(len(convs))
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} prompts ({args.conversations} conversations x {args.turns} turns)")


if __name__ == "__main__":
    main()

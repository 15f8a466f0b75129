"""bench/vllm_client.py: bench/serve.py's workloads become the `vllm bench serve` flags of the
same workload, and the client process runs with vLLM's CPU platform."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import serve, vllm_client


def flags(cli: list[str]) -> dict[str, str | list[str]]:
    """`--name value...` pairs of a command line (a flag alone maps to "")."""
    out: dict[str, str | list[str]] = {}
    name = ""
    for word in cli[2:]:
        if word.startswith("--"):
            name = word
            out[name] = ""
        elif isinstance(out[name], list):
            out[name].append(word)  # type: ignore[union-attr]
        elif out[name]:
            out[name] = [out[name], word]  # type: ignore[list-item]
        else:
            out[name] = word
    return out


def workload(*argv: str) -> dict[str, str | list[str]]:
    args = serve.parser().parse_args(["--base-url", "http://h:8000/v1", *argv])
    cli = vllm_client.serve_cli_args(args, Path("/tok"), Path("/tmp/r/out.json"))
    assert cli[:2] == ["bench", "serve"]
    return flags(cli)


def test_random_closed_loop() -> None:
    got = workload(
        "--num-prompts", "128", "--max-concurrency", "64", "--input-len", "512",
        "--output-len", "128", "--seed", "7", "--goodput", "ttft:2000", "tpot:50",
    )  # fmt: skip
    assert got["--base-url"] == "http://h:8000"  # vllm appends /v1/completions itself
    assert got["--backend"] == "vllm" and got["--tokenizer"] == "/tok"
    assert got["--dataset-name"] == "random"
    assert got["--random-input-len"] == "512" and got["--random-output-len"] == "128"
    assert got["--random-range-ratio"] == "0.0"
    assert got["--num-prompts"] == "128" and got["--max-concurrency"] == "64"
    assert got["--seed"] == "7" and got["--temperature"] == "0"
    assert "--ignore-eos" in got
    assert got["--goodput"] == ["ttft:2000", "tpot:50"]
    assert "--request-rate" not in got  # all at once: vllm's default rate is inf
    assert got["--result-dir"] == "/tmp/r" and got["--result-filename"] == "out.json"


def test_shared_prefix_at_a_rate() -> None:
    got = workload(
        "--dataset", "shared-prefix", "--prefix-len", "1024", "--num-prefixes", "8",
        "--input-len", "128", "--output-len", "64", "--request-rate", "32",
        "--burstiness", "0.5", "--num-warmups", "3",
    )  # fmt: skip
    assert got["--dataset-name"] == "prefix_repetition"
    assert got["--prefix-repetition-prefix-len"] == "1024"
    assert got["--prefix-repetition-suffix-len"] == "128"
    assert got["--prefix-repetition-num-prefixes"] == "8"
    assert got["--prefix-repetition-output-len"] == "64"
    assert got["--request-rate"] == "32.0" and got["--burstiness"] == "0.5"
    assert got["--num-warmups"] == "3"
    assert "--max-concurrency" not in got and "--goodput" not in got
    assert not any(k.startswith("--random-") for k in got)


def test_client_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHLLM_VLLM_CLIENT_PATH", "/c/site:/c/src")
    monkeypatch.setenv("PYTHONPATH", "/x")
    argv, env = vllm_client.command(["bench", "serve", "--help"])
    assert argv[-3:] == ["bench", "serve", "--help"]
    assert env["PYTHONPATH"] == "/c/site:/c/src:/x"
    assert env["VLLM_TARGET_DEVICE"] == "cpu"  # no CUDA platform: its extensions are absent
    assert not vllm_client.available()  # no vllm/benchmarks under /c/...

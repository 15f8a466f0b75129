"""Start-up: how long the mesh takes to serve, and to serve again after a worker dies.

Each run starts redis-server + gateway + scheduler + worker (the e2e settings: SmolLM2,
float32, one torch thread, a 256 MiB KV cache) and times `Mesh.start` (spawn to the gateway
ready), then kills the worker with SIGKILL and times its restart to the gateway serving again.
Prints the median and each run. `--tree DIR` also times another checkout (a worktree of the
baseline commit, e.g. `git worktree add /tmp/old <commit>`), rounds interleaved with this
tree's, so two commits are compared in one session. Each round runs in a fresh interpreter.

    python -m bench.startup --runs 5 [--tree /tmp/old]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(runs: int) -> tuple[list[float], list[float]]:
    from tests.e2e.conftest import E2E_ENV
    from tests.support.mesh import Mesh

    starts, restarts = [], []
    for _ in range(runs):
        mesh = Mesh(env=E2E_ENV)
        try:
            began = time.monotonic()
            mesh.start()
            starts.append(time.monotonic() - began)
            mesh.kill("worker")
            began = time.monotonic()
            mesh.restart("worker")
            restarts.append(time.monotonic() - began)
        finally:
            mesh.stop()
    return starts, restarts


def report(label: str, starts: list[float], restarts: list[float]) -> str:
    def line(xs: list[float]) -> str:
        return f"median {statistics.median(xs):.2f} s ({', '.join(f'{x:.2f}' for x in xs)})"

    return f"{label}: mesh start {line(starts)}; worker kill -9 to serving {line(restarts)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tree", type=Path, help="also time this checkout, rounds interleaved")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # one round in this tree (a child of an interleaved comparison)
        print(*(f"{x:.4f}" for pair in zip(*measure(1), strict=True) for x in pair))
        return
    trees = {"this tree": Path(__file__).resolve().parents[1]}
    if args.tree:
        trees[str(args.tree)] = args.tree.resolve()
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in trees}
    for _ in range(args.runs):
        for name, root in trees.items():
            # This file run as a script against `root`'s tests.support and services (the
            # baseline's checkout need not have this benchmark).
            out = subprocess.run(
                [sys.executable, __file__, "--one"],
                cwd=root,
                env={**os.environ, "PYTHONPATH": str(root)},
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            times[name][0].append(float(out[0]))
            times[name][1].append(float(out[1]))
    for name, (starts, restarts) in times.items():
        print(report(name, starts, restarts))


if __name__ == "__main__":
    main()

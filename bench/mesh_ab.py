"""Two meshes side by side, A and B, in alternating blocks: does a setting change throughput?

On this 2-core VM, whose speed drifts 2-4x over minutes, one mesh measured after the other says
more about the minute than about the setting. Here both meshes are up at once (each idles while
the other serves) and blocks alternate A, B, A, B, ...; reported: each block's output tokens/s
and the B/A ratio per round. Settings are environment variables of the mesh's processes, plus
an optional nice value for every thread of B's worker:

    python -m bench.mesh_ab --b-env GOMP_SPINCOUNT=3000000 --rounds 6
    python -m bench.mesh_ab --b-env MESHLLM_NUM_THREADS=1
    python -m bench.mesh_ab --b-worker-nice -5
    python -m bench.mesh_ab --b-repo /tmp/baseline   # B runs another checkout (e.g. HEAD~1)

Results of 2026-11-30: bench/cpu_mesh_env_2026-11-30.log.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from bench.cpu_compare import stop
from bench.cpu_paired import REPO, _descendants, serve_block, start_mesh


def _env(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--a-env/--b-env take KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def renice_worker(launcher_pid: int, nice: int) -> None:
    """Every thread of the mesh's worker (Linux nice values are per thread)."""
    for pid in _descendants(launcher_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue
        if "services.worker" in cmdline:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--a-env", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--b-env", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--b-worker-nice", type=int, default=None)
    p.add_argument("--b-repo", default="", help="run mesh B from this checkout")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mesh-dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--log-dir", default="bench/results/mesh_ab")
    args = p.parse_args()
    meshes = []
    try:
        for i, pairs in enumerate((args.a_env, args.b_env)):
            args.redis_port = 16411 + i
            log_dir = Path(args.log_dir) / "ab"[i]
            log_dir.mkdir(parents=True, exist_ok=True)
            repo = Path(args.b_repo) if i == 1 and args.b_repo else REPO
            meshes.append(
                start_mesh(
                    args, log_dir, port_offset=310 + 10 * i, extra_env=_env(pairs), repo=repo
                )
            )
        if args.b_worker_nice is not None:
            renice_worker(meshes[1][0].pid, args.b_worker_nice)
        prompts = 2 * args.concurrency
        for _, url in meshes:  # warm: first requests of each mesh are not timed
            serve_block(url, args.concurrency, prompts, args)
        runs: list[list[float]] = [[], []]
        for r in range(args.rounds):
            for i, (_, url) in enumerate(meshes):
                runs[i].append(round(serve_block(url, args.concurrency, prompts, args), 1))
            print(f"round {r}: A {runs[0][-1]} B {runs[1][-1]} tok/s", flush=True)
        ratios = [round(b / a, 3) for a, b in zip(*runs, strict=True)]
        print(f"A {args.a_env} median {statistics.median(runs[0])} tok/s")
        print(
            f"B {args.b_env} nice {args.b_worker_nice} repo {args.b_repo or REPO} "
            f"median {statistics.median(runs[1])} tok/s"
        )
        print(f"B/A per round {ratios}, median {statistics.median(ratios)}")
    finally:
        for proc, _ in meshes:
            stop(proc)


if __name__ == "__main__":
    main()

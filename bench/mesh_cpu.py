"""Where a loaded mesh's CPU goes, process by process: CPU seconds of the worker, scheduler,
gateway, Redis and this client (the load generator) from /proc over a stretch of batch-N load,
per decode step. Optionally records py-spy profiles (`--py-spy PATH --spy gateway,scheduler`;
py-spy is not installed by the Makefile) as raw stacks under --log-dir.

    python -m bench.mesh_cpu                       # 25 s of batch-8 blocks
    python -m bench.mesh_cpu --env MESHLLM_CPU_ATTENTION=torch
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from pathlib import Path

from bench.cpu_compare import stop
from bench.cpu_paired import _descendants, serve_block, start_mesh
from bench.mesh_ab import _env

SERVICES = ("worker", "scheduler", "gateway", "redis-server")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def service_pids(launcher: int) -> dict[str, int]:
    pids = {}
    for pid in _descendants(launcher):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        for name in SERVICES:
            if name in cmd and "launcher" not in cmd:
                pids[name] = pid
    return pids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--seconds", type=float, default=25.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mesh-dtype", default="bfloat16")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--redis-port", type=int, default=16431)
    p.add_argument("--py-spy", default="", help="path of a py-spy binary")
    p.add_argument("--spy", default="", help="services to profile, comma-separated")
    p.add_argument("--log-dir", default="bench/results/mesh_cpu")
    args = p.parse_args()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    proc, url = start_mesh(args, log_dir, port_offset=330, extra_env=_env(args.env))
    try:
        prompts = 2 * args.concurrency
        serve_block(url, args.concurrency, prompts, args)  # warm-up
        pids = {**service_pids(proc.pid), "client": os.getpid()}
        spies = []
        for name in filter(None, args.spy.split(",")) if args.py_spy else ():
            out = str(log_dir / f"spy_{name}.txt")
            cmd = [args.py_spy, "record", "-p", str(pids[name]), "-d", str(int(args.seconds))]
            cmd += ["-r", "200", "-f", "raw", "-o", out, "--nonblocking"]
            spies.append(
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        start, rates = time.time(), []
        while time.time() - start < args.seconds:
            rates.append(serve_block(url, args.concurrency, prompts, args))
        wall = time.time() - start
        used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
        steps = sum(rates) / len(rates) * wall / args.concurrency
        print(f"tok/s per block {[round(r, 1) for r in rates]}; {wall:.1f} s, ~{steps:.0f} steps")
        for name, seconds in used.items():
            print(
                f"{name:13s} {seconds:6.2f} cpu-s {seconds / wall * 100:6.1f}% of a core "
                f"{seconds / steps * 1000:6.2f} ms a step"
            )
        for spy in spies:
            spy.wait()
    finally:
        stop(proc)


if __name__ == "__main__":
    main()

"""One command on the H200: every kernel vs its reference at Llama-3-8B sizes, then timings.

    python3 bench/gpu/kernels_check.py [--out PATH] [--skip-timings] [--skip-checks] [--only a,b]

Writes a JSON (default $OUT/kernels_check.json, else bench/gpu/kernels_check.json) and prints
a markdown table last. Every part runs in its own try/except: a failure is reported and the
remaining parts still run. The GEMV sweep's best configs are printed as a dict literal ready
for kernels/decode_chain/gemv.py H200_CONFIGS.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.gpu.report import Report  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(os.environ.get("OUT", ROOT / "bench" / "gpu")) / "kernels_check.json"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--skip-timings", action="store_true")
    parser.add_argument(
        "--only", default="", help="comma-separated substrings of part names to run (e.g. decode)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_check needs a CUDA GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    report = Report(
        env={
            "gpu": props.name,
            "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
        }
    )
    torch.manual_seed(0)
    start = time.perf_counter()
    # Imported inside a part so that a kernel module that fails to import is reported too.
    parts: list = []  # type: ignore[type-arg]
    with report.part("import kernels"):
        from bench.gpu.kernel_checks import ALL_CHECKS
        from bench.gpu.kernel_timings import ALL_TIMINGS, time_gemv

        parts = ([] if args.skip_checks else ALL_CHECKS) + (
            [] if args.skip_timings else ALL_TIMINGS
        )
        if args.only:
            wanted = [w.strip() for w in args.only.split(",") if w.strip()]
            parts = [(n, f) for n, f in parts if any(w in n for w in wanted)]
    best_gemv = {}
    for name, fn in parts:
        with report.part(name):
            result = fn(report)
            if fn is time_gemv:
                best_gemv = result
            torch.cuda.synchronize()
        torch.cuda.empty_cache()
    report.env["wall_s"] = round(time.perf_counter() - start, 1)
    report.write(args.out)
    if best_gemv:
        print("\nH200_CONFIGS = {")
        for (n, k), cfg in best_gemv.items():
            print(f"    ({n}, {k}): {cfg!r},")
        print("}")
    print(f"\nwrote {args.out}\n")
    print(report.markdown())
    return 1 if report.failures or not all(c["ok"] for c in report.checks) else 0


if __name__ == "__main__":
    sys.exit(main())

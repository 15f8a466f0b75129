"""Host time of one scheduler step (schedule() + update_from_output()), no bus, no worker.

A batch of requests decodes in steady state; the "worker" answers each plan with one token
per sampled request (a StepResult built outside the timed region). Reports, per step, the
median and p99 wall time of the timed part, and its median CPU time (thread CPU clock: on a
shared machine, wall time also counts time spent waiting for a core).

    .venv/bin/python -m bench.scheduler_step --batch 1 8 64 256
"""

from __future__ import annotations

import argparse
import statistics
import time

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.protocol import SampledTokens, SamplingParams, StepPlan, StepResult, SubmitRequest


def result_for(plan: StepPlan, scheduler: Scheduler) -> StepResult:
    sampled = []
    for rid, n in plan.num_scheduled_tokens.items():
        req = scheduler.requests[rid]
        if req.num_computed_tokens >= req.num_tokens:
            sampled.append(SampledTokens(request_id=rid, token_ids=[100 + n % 7]))
    return StepResult(step_id=plan.step_id, worker_id="bench", sampled=sampled)


def measure(batch: int, prompt_len: int, steps: int) -> tuple[float, float, float]:
    config = SchedulerConfig(
        block_size=16,
        num_gpu_blocks=batch * ((prompt_len + steps + 64) // 16 + 2) + 1,
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch * prompt_len),
        max_model_len=prompt_len + steps + 64,
    )
    scheduler = Scheduler(config, "bench")
    shared = list(range(1000, 1000 + prompt_len // 2))  # half of each prompt is shared
    for i in range(batch):
        prompt = [*shared, *(10_000 + i * prompt_len + j for j in range(prompt_len // 2))]
        scheduler.add_request(
            SubmitRequest(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling=SamplingParams(max_tokens=steps + 32, ignore_eos=True),
                reply_stream=f"replies:{i % 4}",
            )
        )
    while len(scheduler.running) < batch or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
    ):  # prefill (untimed)
        plan = scheduler.schedule()
        assert plan is not None
        scheduler.update_from_output(plan, result_for(plan, scheduler))
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        plan = scheduler.schedule()
        t1, c1 = time.perf_counter(), time.thread_time()
        assert plan is not None and len(plan.num_scheduled_tokens) == batch
        result = result_for(plan, scheduler)
        t2, c2 = time.perf_counter(), time.thread_time()
        scheduler.update_from_output(plan, result)
        t3, c3 = time.perf_counter(), time.thread_time()
        times.append((t1 - t0) + (t3 - t2))
        cpu.append((c1 - c0) + (c3 - c2))
    times.sort()
    p99 = times[int(len(times) * 0.99)]
    return statistics.median(times) * 1e6, p99 * 1e6, statistics.median(cpu) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    print("| running | wall median (us) | wall p99 (us) | CPU median (us) | CPU per request (us) |")
    print("|---|---|---|---|---|")
    for batch in args.batch:
        median, p99, cpu = measure(batch, args.prompt_len, args.steps)
        print(f"| {batch} | {median:.0f} | {p99:.0f} | {cpu:.0f} | {cpu / batch:.2f} |")


if __name__ == "__main__":
    main()

"""The runner's chained verify step (chain.py): launched without the previous step's tokens
on the host, answered when its own land.

On CUDA the whole step is one replay of a chained graph (accel/chain_graphs.py) after one
upload of the requests' rows, slots, token limits and block tables. Where those graphs do not
hold the step's draw (top-k, top-p, min-p), the pieces run one by one: the block tables go up,
the layout kernel writes the verify graph's inputs (accel/verify_graphs.py), then the LM head,
the draw and the acceptance kernel. On the CPU, where nothing runs ahead anyway, the real rows
are read back and run eagerly: the same drafts, acceptance and device tokens, which is what
the CPU tests check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from prometheus_client import Counter

from services.worker.accel.cuda_graphs import padded_size
from services.worker.models.base import split_aux_hidden
from services.worker.runner.in_flight import InFlightTokens
from services.worker.sampling import SamplerOutput
from services.worker.spec.chain import ChainedInputs, DraftChain
from shared.metrics import metric_name
from shared.protocol import SampledTokens, SamplingParams, StepPlan
from shared.protocol.trusted import TrustedBuilder

if TYPE_CHECKING:
    from services.worker.runner.model_runner import ModelRunner
    from services.worker.runner.step_timeline import StepMarks

_sampled_tokens = TrustedBuilder(SampledTokens)
CHAINED_STEPS = Counter(
    metric_name("worker_spec_chained_steps_total"),
    "Verify steps chained on the device: n-gram drafts proposed, laid out and accepted there",
)


def launch_chained(
    runner: ModelRunner, plan: StepPlan, marks: StepMarks | None = None
) -> InFlightTokens:
    """Queue the plan's chained verify step (ModelRunner._chains said it is one)."""
    chain = runner.chain
    assert chain is not None
    batch = runner.batch
    ids = list(plan.num_scheduled_tokens)
    rows = np.fromiter((batch.req_rows[r] for r in ids), dtype=np.int64, count=len(ids))
    slots = np.fromiter((plan.spec_lookahead[r] for r in ids), dtype=np.int64, count=len(ids))
    params: list[SamplingParams | None] = [batch.sampling[int(r)] for r in rows]
    limits = batch.num_prompt_tokens[rows] + np.array(
        [p.max_tokens if p is not None else batch.max_model_len for p in params], dtype=np.int64
    )
    if marks is not None:
        marks.shape(1 + slots, slots)
    chain.sync(batch, rows, runner._to_device)
    whole = runner.chain_graphs
    size = padded_size(len(ids), whole.sizes) if whole is not None else None
    if whole is not None and size in whole.graphs and not runner.sampler.truncates:
        runner.mark_phase("inputs")
        whole.stage_step(size, rows, slots, limits, batch.block_tables[0, rows])
        packed = whole.run_step(size, len(ids))
        runner.mark_phase("verified")
        return _in_flight(runner, ids, rows, slots, params, packed)
    window = chain.window(batch, rows) if runner.device.type != "cuda" else 0  # CPU lookup only
    columns = runner._to_device(np.stack([rows, slots, limits]))
    rows_t, slots_t, limits_t = columns[0], columns[1], columns[2]
    tables = batch.block_tables[0, rows]
    graphs = runner.verify_graphs
    runner.mark_phase("inputs")
    if graphs is not None:
        size = padded_size(len(ids), graphs.sizes)
        assert size is not None
        static = graphs.stage_tables(size, tables)
        tables_t = static["block_tables"][: len(ids)]
        step = chain.lay_out(
            rows_t, slots_t, limits_t, tables_t, runner.block_size, window, into=static
        )
        hidden = graphs.run_chained(size, len(ids) * chain.width)
    else:
        tables_t = torch.from_numpy(np.ascontiguousarray(tables)).to(runner.device)
        step = chain.lay_out(rows_t, slots_t, limits_t, tables_t, runner.block_size, window)
        hidden = _eager_forward(runner, rows, step)
    runner.mark_phase("forward")
    width = chain.width
    logits = runner.compute_logits(hidden)
    # row j of request i samples position T + j: the row's position + 1 (pads repeat the last)
    out = runner.sampler.sample(logits, rows_t.repeat_interleave(width), step.positions + 1)
    packed = chain.accept(rows_t, step, out.token_ids.view(len(ids), width), runner.feed.latest)
    runner.mark_phase("verified")
    return _in_flight(runner, ids, rows, slots, params, packed)


def _in_flight(
    runner: ModelRunner,
    ids: list[str],
    rows: np.ndarray,
    slots: np.ndarray,
    params: list[SamplingParams | None],
    packed: torch.Tensor,
) -> InFlightTokens:
    """The step's packed result on its way to the host; its rows may hold 1 + slots more
    tokens each once it lands."""
    assert runner.chain is not None
    tokens = InFlightTokens.start(
        ids, rows, params, SamplerOutput(token_ids=packed), runner.download_stream
    )
    tokens.chained = slots
    runner.feed.launched(tokens)
    runner.chain.ahead[rows] += 1 + slots
    CHAINED_STEPS.inc()
    return tokens


def _eager_forward(runner: ModelRunner, rows: np.ndarray, step: ChainedInputs) -> torch.Tensor:
    """CPU: the step's real rows run eagerly from host copies of the layout; hidden [R * W, H]
    with zeros for the pads."""
    from services.worker.runner.model_runner import StepInputs

    real = step.real.cpu().numpy()
    flat = np.flatnonzero(real.reshape(-1))
    query_lens = real.sum(axis=1)
    kept = np.flatnonzero(query_lens)
    if not kept.size:
        dtype = next(runner.model.parameters()).dtype
        return torch.zeros(real.size, runner.config.hidden_size, dtype=dtype)
    lengths = step.lengths.cpu().numpy()
    inputs = StepInputs(
        request_ids=[""] * len(kept),
        rows=rows[kept],
        query_lens=query_lens[kept],
        seq_lens=lengths[kept] - 1 + query_lens[kept],
        input_ids=step.input_ids.cpu().numpy()[flat],
        positions=step.positions.cpu().numpy()[flat],
        slot_mapping=step.slots.cpu().numpy()[flat],
        sample_mask=np.ones(len(kept), dtype=bool),
    )
    out, _ = split_aux_hidden(runner._forward(inputs, eager=True), runner.config.hidden_size)
    hidden = out.new_zeros(real.size, out.shape[1])
    hidden[torch.from_numpy(flat)] = out
    return hidden


def land_chained(
    runner: ModelRunner, tokens: InFlightTokens, live: np.ndarray
) -> list[SampledTokens]:
    """A chained step's packed result is on the host: append and answer (DraftChain.land)."""
    chain: DraftChain | None = runner.chain
    assert chain is not None and tokens.chained is not None
    packed = tokens.host.token_ids.numpy()
    emitted = chain.land(runner.batch, tokens.rows, tokens.chained, live, packed)
    return [
        _sampled_tokens(request_id=tokens.request_ids[i], token_ids=ids, num_drafts=drafts)
        for i, ids, drafts in emitted
    ]

"""The runner's speculative sampling path: logits at every draft position, one draw per
position, acceptance, and the batch rolled forward to the accepted tokens only.

Called by ModelRunner when a step carries drafts, or when some row holds sampled drafts the
plan did not carry (proposals.py). Requests without drafts in the same step are the k = 0 case
(one row, the plain draw), so a mixed batch runs one path. Draws run position by position
(j = 0..max k) over the requests that have a row j, so each sampler call sees every state row
at most once (the sampler's per-row tables assume that) and row j uses position T + j: the
noise plain decoding would use there. Each request is then decided by its rule (verify.py):
same noise from those draws, or rejection sampling for sampled drafts (rejection.py), which
also needs the rows' distributions p.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from services.worker.runner.input_batch import PlanError
from services.worker.sampling.state import SamplerOutput
from services.worker.spec.rejection import RejectionChecks
from services.worker.spec.verify import num_accepted
from shared.protocol import SampledTokens, StepPlan
from shared.protocol.trusted import TrustedBuilder

if TYPE_CHECKING:
    from services.worker.runner.model_runner import ModelRunner, StepInputs


def bitmask_rows(
    plan: StepPlan, request_ids: list[str], num_drafts: np.ndarray, device: torch.device
) -> tuple[torch.Tensor | None, np.ndarray]:
    """(bitmask [G, W] int32 or None, first bitmask row of each request or -1). Each listed
    grammar request owns 1 + len(its drafts) consecutive rows (StepPlan.spec_token_ids)."""
    first = np.full(len(request_ids), -1, dtype=np.int64)
    if not plan.grammar_request_ids:
        return None, first
    sizes = [1 + len(plan.spec_token_ids.get(rid, ())) for rid in plan.grammar_request_ids]
    total = sum(sizes)
    raw = plan.grammar_bitmask
    if len(raw) % 4 or not raw or (len(raw) // 4) % total:
        raise PlanError(
            f"grammar_bitmask has {len(raw)} bytes, not a positive multiple of 4 bytes x "
            f"{total} rows ({len(sizes)} grammar requests and their drafts)"
        )
    starts = np.cumsum([0, *sizes[:-1]])
    position = dict(zip(plan.grammar_request_ids, starts.tolist(), strict=True))
    for i, request_id in enumerate(request_ids):
        first[i] = position.get(request_id, -1)
    if not (first >= 0).any():
        return None, first
    packed = np.frombuffer(raw, dtype="<i4").reshape(total, -1).copy()
    return torch.from_numpy(packed).to(device), first


def verify_and_sample(
    runner: ModelRunner, hidden: torch.Tensor, inputs: StepInputs, plan: StepPlan
) -> list[SampledTokens]:
    """Sample every sampling request of a speculative step; returns its accepted tokens."""
    assert inputs.num_drafts is not None
    batch, sampler = runner.batch, runner.sampler
    sample_idx = np.flatnonzero(inputs.sample_mask)
    if not sample_idx.size:
        return []
    ids = [inputs.request_ids[i] for i in sample_idx]
    rows = inputs.rows[sample_idx]
    k = inputs.num_drafts[sample_idx]
    counts = k + 1  # logits rows of each request, request-major: positions T .. T + k
    req = np.repeat(np.arange(len(k)), counts)
    j = np.arange(len(req)) - (np.cumsum(counts) - counts)[req]
    ends = np.cumsum(inputs.query_lens)[sample_idx]  # flat end (exclusive) of each request
    flat = (ends - 1 - k)[req] + j  # the hidden row that samples position T + j
    bitmask, bitmask_first = bitmask_rows(plan, ids, k, runner.device)
    verified = batch.num_tokens[rows].copy()  # T: tokens known before this step's drafts
    checks = RejectionChecks.find(runner, rows, verified, k)

    grammar = (bitmask, bitmask_first)
    if not checks.proposals and sampler.rows_repeatable and not sampler.counts_outputs:
        # one upload for the gather and the sampler's state rows and positions
        staged = runner._to_device(np.stack([flat, rows[req], verified[req] + j]))
        logits = runner.compute_logits(hidden[staged[0]])
        draws, logprobs, top = _draw_at_once(runner, logits, staged, k, grammar, req, j)
    else:
        logits = runner.compute_logits(hidden[runner._to_device(flat)])
        draws, logprobs, top = _draw_by_position(runner, logits, rows, verified, k, grammar, checks)
        # (it recorded each position's drafts for the next, and took them back)
    runner.mark_phase("drawn")
    decided = checks.decide(runner, rows, verified)

    result: list[SampledTokens] = []
    rec_rows: list[int] = []
    rec_tokens: list[int] = []
    for i, request_id in enumerate(ids):
        row, t, n = int(rows[i]), int(verified[i]), int(k[i])
        drafts = batch.token_ids[row, t : t + n].tolist()
        if i in decided:
            tokens, token_logprobs = decided[i].tokens(drafts, draws[i], logprobs[i])
            logprobs[i, : len(token_logprobs)] = token_logprobs
            a = min(len(tokens) - 1, n)
        else:  # same noise (verify.py): the emitted tokens are the plain draws
            a = num_accepted(drafts, draws[i, : n + 1].tolist())
            tokens = draws[i, : a + 1].tolist()
        room = min(len(tokens), batch.max_model_len - t)  # only a no-draft row at the limit
        batch.token_ids[row, t : t + room] = tokens[:room]
        batch.num_tokens[row] = t + room
        batch.num_computed_tokens[row] = t + a  # KV stands for the verified and accepted
        rec_rows += [row] * len(tokens)
        rec_tokens += tokens
        result.append(_sampled(request_id, tokens, batch.sampling[row], logprobs[i], top, i, k))
    if sampler.counts_outputs:
        recorded = runner._to_device(np.array([rec_rows, rec_tokens]))
        sampler.record_sampled(recorded[0], recorded[1])
    return result


# the values are ints and floats this process just made: no validation (shared/protocol/trusted.py)
_sampled_tokens = TrustedBuilder(SampledTokens)

Grammar = tuple[torch.Tensor | None, np.ndarray]  # bitmask, each request's first row or -1
Top = dict[int, tuple[np.ndarray, np.ndarray]]  # position j -> top ids/logprobs of k >= j rows


def _sample(
    runner: ModelRunner,
    logits: torch.Tensor,
    rows: np.ndarray,
    verified: np.ndarray,
    grammar: Grammar,
    req: np.ndarray,
    j: np.ndarray | int,
    return_probs: bool = False,
) -> SamplerOutput:
    """One sampler call: logits row i is request req[i] at draft position j (j[i]): its state
    row, position T + j and grammar bitmask row (`_bitmask_index`)."""
    return runner.sampler.sample(
        logits,
        runner._to_device(rows[req]),
        runner._to_device(verified[req] + j),
        grammar[0],
        bitmask_index=_bitmask_index(runner, grammar, req, j),
        return_probs=return_probs,
    )


def _bitmask_index(
    runner: ModelRunner, grammar: Grammar, req: np.ndarray, j: np.ndarray | int
) -> torch.Tensor | None:
    """Each logits row's grammar bitmask row (its request's first + j, -1 where
    unconstrained), on the device; None without a bitmask."""
    bitmask, first = grammar
    if bitmask is None:
        return None
    return runner._to_device(np.where(first[req] >= 0, first[req] + j, -1))


def _draw_at_once(
    runner: ModelRunner,
    logits: torch.Tensor,
    staged: torch.Tensor,
    k: np.ndarray,
    grammar: Grammar,
    req: np.ndarray,
    j: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, Top]:
    """Every (request, position) draw in one sampler call over the logits as they are laid
    out (request-major: logits row m is request req[m] at position j[m]; `staged` rows 1 and
    2 are its state row and position on the device), where the sampler allows a state row more
    than once per call (no per-entry stage: SamplingState.rows_repeatable) and no draw needs
    its distribution kept (no rejection check). Each row draws with its own (row, position)
    noise: the same tokens as one call per position."""
    starts = np.cumsum(k + 1) - (k + 1)
    index = _bitmask_index(runner, grammar, req, j)
    out = runner.sampler.sample(logits, staged[1], staged[2], grammar[0], bitmask_index=index)
    draws = np.full((len(k), int(k.max()) + 1), -1, dtype=np.int64)
    draws[req, j] = out.token_ids.to("cpu", torch.int64).numpy()
    logprobs = np.zeros(draws.shape, dtype=np.float32)
    if out.logprobs is not None:
        logprobs[req, j] = out.logprobs.cpu().numpy()
    top: Top = {}
    if out.top_token_ids is not None and out.top_logprobs is not None:
        ids, values = out.top_token_ids.cpu().numpy(), out.top_logprobs.cpu().numpy()
        for position in range(draws.shape[1]):
            at = starts[k >= position] + position
            top[position] = (ids[at], values[at])
    return draws, logprobs, top


def _draw_by_position(
    runner: ModelRunner,
    logits: torch.Tensor,
    rows: np.ndarray,
    verified: np.ndarray,
    k: np.ndarray,
    grammar: Grammar,
    checks: RejectionChecks,
) -> tuple[np.ndarray, np.ndarray, Top]:
    """One sampler call per position j over the requests with a row j (each state row at most
    once per call), keeping the checked rows' distributions for rejection sampling. Where the
    sampling reads what was output (penalties, min_tokens, bad words), position j sees the
    drafts before it recorded as outputs (SamplingState.provisional). The
    outputs stay on the device until the loop is done, then come back in one copy: a
    read-back per position would wait for the GPU k + 1 times a step."""
    offsets = np.cumsum(k + 1) - (k + 1)  # each request's first logits row
    picked: list[tuple[np.ndarray, SamplerOutput]] = []
    history = runner.sampler.provisional()
    for j in range(int(k.max()) + 1):
        sel = np.flatnonzero(k >= j)
        if j:  # position j's history holds the drafts before it, as plain decoding's would
            drafts = runner.batch.token_ids[rows[sel], verified[sel] + j - 1]
            recorded = runner._to_device(np.stack([rows[sel], drafts]))
            history.record(recorded[0], recorded[1])
        checked = checks.rows_at(j, sel)
        out = _sample(
            runner, logits[runner._to_device(offsets[sel] + j)], rows, verified, grammar, sel, j,
            return_probs=bool(checked.size),
        )  # fmt: skip
        checks.collect(out, checked, runner)
        picked.append((sel, out))
    history.undo()  # the caller records the tokens accepted
    draws = np.full((len(k), len(picked)), -1, dtype=np.int64)
    logprobs = np.zeros(draws.shape, dtype=np.float32)
    tokens = torch.cat([out.token_ids.to(torch.int64) for _, out in picked]).cpu().numpy()
    top: Top = {}
    start = 0
    for j, (sel, out) in enumerate(picked):  # the copies below find the GPU done
        draws[sel, j] = tokens[start : start + len(sel)]
        start += len(sel)
        if out.logprobs is not None:
            logprobs[sel, j] = out.logprobs.cpu().numpy()
        if out.top_token_ids is not None and out.top_logprobs is not None:
            top[j] = (out.top_token_ids.cpu().numpy(), out.top_logprobs.cpu().numpy())
    return draws, logprobs, top


def _sampled(
    request_id: str,
    tokens: list[int],
    params: object,
    logprobs: np.ndarray,
    top: dict[int, tuple[np.ndarray, np.ndarray]],
    i: int,
    k: np.ndarray,
) -> SampledTokens:
    fields: dict[str, object] = {
        "request_id": request_id,
        "token_ids": tokens,
        "num_drafts": int(k[i]),
    }
    want = getattr(params, "logprobs", None)
    n = len(tokens)
    if want is not None:
        fields["logprobs"] = logprobs[:n].tolist()
        if want and top:
            ids: list[int] = []
            values: list[float] = []
            for j in range(n):
                # row of request i within draw j's selection: requests with k >= j, in order
                pos = int(np.count_nonzero(k[:i] >= j))
                ids += top[j][0][pos][:want].tolist()
                values += top[j][1][pos][:want].tolist()
            fields["top_token_ids"] = ids
            fields["top_logprobs"] = values
    return _sampled_tokens(**fields)

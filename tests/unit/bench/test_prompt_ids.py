"""bench/gpu/mesh_decode.prompt_ids: the GPU benchmarks' prompts share no prefix-cache block
between requests of any run, so no run is served from an earlier run's cache (the affine
prompts salted per run that it replaced made 16 of `direct-64-0`'s 64 prompts those of
`direct-16-0`)."""

from bench.gpu.mesh_decode import prompt_ids

BLOCK = 16  # the scheduler's default block: the prefix cache matches whole blocks


def request_ids() -> list[str]:
    """Every request id gateway_serve's direct runs and mesh_decode's runs send in one call
    (`<tag>-<i>` for the run's batch of `i`s)."""
    runs = [("warm", 1), ("warm-max", 256)]
    runs += [(f"direct-{c}-{r}", c) for c in (1, 16, 64, 256) for r in range(4)]
    runs += [(f"run{r}.{i}-b{b}", b) for r in range(4) for i, b in enumerate((1, 16, 64, 256))]
    return [f"{tag}-{i}" for tag, batch in runs for i in range(batch)]


def test_no_two_requests_share_a_first_block() -> None:
    ids = request_ids()
    assert len(ids) > 2000
    for vocab in (49_152, 128_256):  # the SmolLM2 tokenizer's and Llama-3's vocabularies
        firsts = {tuple(prompt_ids(rid, BLOCK, vocab)) for rid in ids}
        assert len(firsts) == len(ids)


def test_a_request_id_always_draws_the_same_prompt_in_range() -> None:
    a = prompt_ids("direct-64-0-3", 512, 49_152)
    assert a == prompt_ids("direct-64-0-3", 512, 49_152)
    assert len(a) == 512 and min(a) >= 0 and max(a) < 49_152
    assert len(set(a)) > 400  # drawn, not a pattern of a few ids

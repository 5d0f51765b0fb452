import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.decoding.sampling import RowStreams, SamplingParams, counter_uniforms, filter_logits, row_seed, sample_next

# Chi-square critical value for df=3 at p=0.001: a correct sampler fails this 1 time in 1000.
CHI2_DF3_P001 = 16.27


def test_row_seed_is_stable_and_distinct():
    assert row_seed(0, "abc", 1) == row_seed(0, "abc", 1)
    seeds = {row_seed(s, p, i) for s in (0, 1) for p in ("a", "b") for i in range(8)}
    assert len(seeds) == 32
    assert all(0 <= s < 2**63 for s in seeds)


def test_top_k_and_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k2 = filter_logits(logits, SamplingParams(top_k=2))
    assert torch.isfinite(k2).tolist() == [[True, True, False, False]]
    p = filter_logits(logits, SamplingParams(top_p=0.7))  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    assert torch.isfinite(p).tolist() == [[True, True, False, False]]
    p = filter_logits(logits, SamplingParams(top_p=0.5))
    assert torch.isfinite(p).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("streams", ["generators", "row streams"])
def test_sampler_matches_distribution_chi_square(streams):
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 4000
    logits = torch.log(probs).expand(n, 4)
    seeds = [row_seed(0, "p", i) for i in range(n)]
    source = (RowStreams.seeded(seeds) if streams == "row streams"
              else [torch.Generator().manual_seed(s) for s in seeds])
    tokens = sample_next(logits, SamplingParams(), source)
    counts = torch.bincount(tokens, minlength=4).double()
    expected = probs.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_DF3_P001, (counts.tolist(), chi2)


def test_sampler_is_per_row_reproducible():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    a = sample_next(logits, SamplingParams(), [torch.Generator().manual_seed(s) for s in range(6)])
    b = sample_next(logits[3:4], SamplingParams(), [torch.Generator().manual_seed(3)])
    assert a[3] == b[0]
    assert torch.equal(sample_next(logits, SamplingParams(temperature=0), []), logits.argmax(-1))


def test_row_streams_are_per_row_reproducible_and_counted():
    """A row's i-th draw depends on its seed and i alone: not on the rows beside it, their order,
    or how its earlier draws were taken (alone, in a batch, through a one-row view)."""
    seeds = [row_seed(3, "p", i) for i in range(6)]
    batch = RowStreams.seeded(seeds)
    draws = torch.stack([batch.draw() for _ in range(5)])  # [5, 6]
    alone = RowStreams.seeded(seeds[4:5])
    assert torch.equal(torch.stack([alone.draw()[0] for _ in range(5)]), draws[:, 4])
    again = RowStreams.seeded(seeds)
    again.draw()
    picked = again.select(torch.tensor([5, 2]))
    picked.draw()
    view = again.row(2)
    view.draw()  # moves row 2 of ``again`` too
    assert again.counters.tolist() == [1, 1, 2, 1, 1, 1]
    assert picked.draw().tolist() == [draws[2, 5].item(), draws[2, 2].item()]
    assert torch.equal(again.draw()[2], draws[2, 2])
    joined = RowStreams.cat([RowStreams.seeded(seeds[:2]), RowStreams.seeded(seeds[2:])])
    assert torch.equal(joined.draw(), draws[0])
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    a = sample_next(logits, SamplingParams(), RowStreams.seeded(seeds))
    b = sample_next(logits[3:4], SamplingParams(), RowStreams.seeded(seeds[3:4]))
    assert a[3] == b[0]


CHI2_DF255_P001 = 330.5
"""Chi-square critical value for df = 255 at p = 0.001."""


@pytest.mark.parametrize("pairing", ["a row's consecutive draws", "neighbouring seeds' same draw"])
def test_counter_uniforms_are_uniform_and_independent(pairing):
    """Pairs of uniforms fall evenly in a 16 x 16 grid: within a row, draw i against draw i + 1;
    across rows whose seeds differ in one bit, the same draw. A hash with weak mixing fails one of
    them (the seeds 0, 1, 2, ... and counters 0, 1, 2, ... are the hardest inputs)."""
    n = 20000
    if pairing == "a row's consecutive draws":
        keys = torch.tensor([[12345, 678]]).expand(n + 1, 2)
        u = counter_uniforms(keys, torch.arange(n + 1))
        first, second = u[:-1], u[1:]
    else:
        keys = torch.stack([torch.arange(2 * n), torch.zeros(2 * n, dtype=torch.long)], 1)
        u = counter_uniforms(keys, torch.zeros(2 * n, dtype=torch.long))
        first, second = u[0::2], u[1::2]  # seeds 2k and 2k + 1
    assert 0 <= float(u.min()) and float(u.max()) < 1
    cells = (first * 16).long() * 16 + (second * 16).long()
    counts = torch.bincount(cells, minlength=256).double()
    expected = n / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_DF255_P001, chi2


@settings(max_examples=30, deadline=None)
@given(seeds=st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=5), count=st.integers(1, 6),
       skip=st.integers(0, 3), data=st.data())
def test_uniforms_drawn_ahead_are_the_draws_one_at_a_time(seeds, count, skip, data):
    """RowStreams.ahead(k) gives each row's next k draws without moving it; advance moves each row by
    what it used, after which its draws go on exactly where one-at-a-time draws would be."""
    one, batch = RowStreams.seeded(seeds), RowStreams.seeded(seeds)
    for _ in range(skip):
        one.draw(), batch.draw()
    used = data.draw(st.lists(st.integers(0, count), min_size=len(seeds), max_size=len(seeds)))
    ahead = batch.ahead(count)
    assert torch.equal(batch.counters, one.counters)  # not moved
    singles = torch.stack([one.draw() for _ in range(count)], dim=1)  # [B, count]
    assert torch.equal(ahead, singles)
    batch.advance(used)
    expected = counter_uniforms(one.keys, torch.tensor([skip + u for u in used]))
    assert torch.equal(batch.draw(), expected)

"""RowBatch (pipeline.engines.rows), the one KV row-batch every engine uses: whatever path a batch
took (left-padded prefill, fan-out, row selection, token and chunk feeding, truncation, tree
verification and commit, rebuilding from per-row entries or snapshots), each row's logits equal
an unpadded run of that row's sequence with no cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline.decoding.tree import TokenTree
from pipeline.engines.rows import RowBatch

ATOL = 1e-4
PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 60, 61, 62]]  # different lengths: left padding


def fresh_logits(model, tokens: list[int]) -> torch.Tensor:
    """Next-token logits after ``tokens`` from one unpadded forward pass with no cache: [V]."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1]


def assert_rows_match(model, logits: torch.Tensor, sequences: list[list[int]]) -> None:
    assert logits.shape[0] == len(sequences)
    for row, seq in zip(logits, sequences):
        torch.testing.assert_close(row, fresh_logits(model, seq), atol=ATOL, rtol=0)


def assert_consistent(rows: RowBatch) -> None:
    """Every attended column is one real token, and the cache is as wide as the mask."""
    assert rows.attention_mask.sum(-1).tolist() == rows.next_position.tolist()
    assert rows.cache.get_seq_length() == rows.attention_mask.shape[1]


def test_prefill_fan_out_select_feed_equal_full_forward_passes(engine):
    model = engine.model
    owner = SimpleNamespace(forward_passes=10)
    rows, out = RowBatch.prefill(model, PROMPTS, engine.pad_id, "cpu", counted_by=(owner,), logits_to_keep=1)
    assert_rows_match(model, out.logits[:, -1], PROMPTS)
    rows.fan_out(2)  # rows: p0 p0 p1 p1 p2 p2
    seqs = [p for p in PROMPTS for _ in range(2)]
    assert_consistent(rows)
    index = rows.select([5, 0, 0, 3])  # reorder, drop, repeat
    assert index.tolist() == [5, 0, 0, 3]
    seqs = [seqs[i] for i in [5, 0, 0, 3]]
    for step in ([7, 8, 9, 10], [11, 12, 13, 14]):
        out = rows.feed(torch.tensor(step)[:, None], logits_to_keep=1)
        seqs = [s + [t] for s, t in zip(seqs, step)]
        assert_rows_match(model, out.logits[:, -1], seqs)
    out = rows.feed(torch.tensor([[20, 21], [22, 23], [24, 25], [26, 27]]))  # two tokens per row
    seqs = [s + t for s, t in zip(seqs, [[20, 21], [22, 23], [24, 25], [26, 27]])]
    assert_rows_match(model, out.logits[:, -1], seqs)
    assert_consistent(rows)
    assert rows.forward_passes == 4 and owner.forward_passes == 14  # prefill + 3 feeds, on both counters


def test_select_identity_keeps_the_cache_and_empty_selection_frees_it(engine):
    rows, _ = RowBatch.prefill(engine.model, PROMPTS, engine.pad_id, "cpu")
    keys = rows.cache.layers[0].keys
    assert rows.select([0, 1, 2]).tolist() == [0, 1, 2]
    assert rows.cache.layers[0].keys is keys  # nothing moved
    assert rows.select([]).tolist() == []
    assert rows.cache.get_seq_length() == 0 and rows.attention_mask.shape[0] == 0 and len(rows.next_position) == 0


def test_truncate_and_padded_chunks_equal_full_rescoring(engine):
    """The streaming reward scorer's path: rows forget their cached tail (masked-out columns, not
    cut) and continue with chunks of different lengths, left-padded, at their true positions."""
    model = engine.model
    rows = RowBatch.empty(model, 3, "cpu")
    seqs = [[1, 5, 6, 7, 8], [1, 9], [1, 10, 11, 12]]
    out = rows.feed_padded(seqs, engine.pad_id)  # a prefill on an empty batch
    assert_rows_match(model, out.logits[:, -1], seqs)
    keep = [3, 2, 4]  # row 0 forgets two tokens, row 2 none
    rows.truncate(keep)
    assert rows.next_position.tolist() == keep
    assert_consistent(rows)
    chunks = [[30, 31, 32], [33], [34, 35]]
    out = rows.feed_padded(chunks, engine.pad_id)
    seqs = [s[:k] + c for s, k, c in zip(seqs, keep, chunks)]
    assert_rows_match(model, out.logits[:, -1], seqs)
    rows.truncate([1, 10, 4])  # row 0 back to its first token only; lengths past the end keep all
    out = rows.feed_padded([[40], [41, 42], [43]], engine.pad_id)
    seqs = [seqs[0][:1] + [40], seqs[1] + [41, 42], seqs[2][:4] + [43]]
    assert_rows_match(model, out.logits[:, -1], seqs)
    assert rows.next_position.tolist() == [len(s) for s in seqs]
    assert_consistent(rows)


def test_verify_then_commit_equals_decoding_the_accepted_paths(engine):
    model = engine.model
    rows, _ = RowBatch.prefill(model, PROMPTS[:2], engine.pad_id, "cpu")
    trees = [TokenTree([60, 61, 62, 63, 64], [-1, 0, 0, 1, 3]), TokenTree([70, 71, 72], [-1, -1, 1])]
    logits = rows.verify(trees)  # [B, N, V]
    for b, tree in enumerate(trees):
        for node in range(len(tree.tokens)):
            branch = [tree.tokens[i] for i in tree.path_to(node)]
            torch.testing.assert_close(logits[b, node], fresh_logits(model, PROMPTS[b] + branch), atol=ATOL, rtol=0)
    sources = [(0, [0, 1, 3]), (1, [1, 2]), (0, [0, 2]), (1, [])]  # one row feeds two outputs; one accepts nothing
    rows.commit(sources)
    assert rows.verification is None and rows.forward_passes == 2
    seqs = [PROMPTS[r] + [trees[r].tokens[i] for i in path] for r, path in sources]
    assert_consistent(rows)
    out = rows.feed(torch.tensor([[80], [81], [82], [83]]))
    assert_rows_match(model, out.logits[:, -1], [s + [t] for s, t in zip(seqs, [80, 81, 82, 83])])
    rows.verify([TokenTree([1], [-1])] * 4)
    rows.commit([])  # nothing survives: the cache is freed
    assert rows.cache.get_seq_length() == 0 and rows.attention_mask.shape[0] == 0
    with pytest.raises(ValueError, match="verify first"):
        rows.commit([(0, [])])


def test_rows_from_per_node_entries_equal_their_paths(engine):
    """ULTS's path cache: per-row KV entries of different lengths, left-padded into one batch."""
    model = engine.model
    roots = [RowBatch.prefill(model, [p], engine.pad_id, "cpu")[0] for p in PROMPTS[:2]]
    entries = [r.entries(0) for r in roots]
    assert entries[0][0][0].shape[1] == len(PROMPTS[0])  # [H, n, D]
    rows = RowBatch.from_entries(model, [[entries[0]], [entries[1]]], "cpu")
    assert_consistent(rows)
    out = rows.feed(torch.tensor([[5], [6]]))
    assert_rows_match(model, out.logits[:, -1], [PROMPTS[0] + [5], PROMPTS[1] + [6]])
    node = rows.entries(1, last=1)  # the entry of token 6 after prompt 1
    deeper = RowBatch.from_entries(model, [[entries[1], node], [entries[0]]], "cpu")
    out = deeper.feed(torch.tensor([[7], [8]]))
    assert_rows_match(model, out.logits[:, -1], [PROMPTS[1] + [6, 7], PROMPTS[0] + [8]])


def test_gather_from_snapshots_resumes_rows(engine):
    """The draft model's resume: rows picked from earlier snapshots continue as if never stopped;
    a snapshot does not change while its batch moves on."""
    model = engine.model
    rows, _ = RowBatch.prefill(model, PROMPTS, engine.pad_id, "cpu")
    first = rows.snapshot()
    mask, keys = first.attention_mask.clone(), first.layers[0][0].clone()
    rows.select([2, 0])
    rows.feed(torch.tensor([[5], [6]]))
    second = rows.snapshot()
    rows.feed(torch.tensor([[7], [8]]))
    assert torch.equal(first.attention_mask, mask) and torch.equal(first.layers[0][0], keys)
    resumed = RowBatch.gather(model, [(second, 1), (second, 0), (second, 1)])
    assert_consistent(resumed)
    out = resumed.feed(torch.tensor([[9], [10], [11]]))
    assert_rows_match(model, out.logits[:, -1], [PROMPTS[0] + [6, 9], PROMPTS[2] + [5, 10], PROMPTS[0] + [6, 11]])
    again = RowBatch.gather(model, [(first, 1), (first, 2)])
    out = again.feed(torch.tensor([[12, 13], [14, 15]]))
    assert_rows_match(model, out.logits[:, -1], [PROMPTS[1] + [12, 13], PROMPTS[2] + [14, 15]])


def test_concat_and_split_keep_each_rows_logits(engine):
    """The step loop's re-cuts of its shared batch: batches of different cache lengths concatenated
    (left-padded to the longest) and split back decode each row as its own batch does, within 1e-5;
    a split part drops the leading columns none of its rows attends to."""
    model = engine.model
    groups = ((PROMPTS[:2], 2), ([[1, 70, 71, 72, 73, 74, 75, 76, 77, 78]], 1), (PROMPTS[2:], 3))  # 4 + 1 + 3 rows

    def batches() -> list[RowBatch]:
        out = []
        for prompts, fan in groups:
            rows, _ = RowBatch.prefill(model, prompts, engine.pad_id, "cpu")
            rows.fan_out(fan)
            out.append(rows)
        return out

    separate, twins = batches(), batches()
    shared = RowBatch.concat(twins)
    assert_consistent(shared)
    assert shared.attention_mask.shape[1] == max(r.attention_mask.shape[1] for r in separate)

    def step(batches: list[RowBatch], token: int) -> list[torch.Tensor]:
        return [b.feed(torch.full((len(b.next_position), 1), token), logits_to_keep=1).logits[:, -1] for b in batches]

    for token in (7, 8):
        torch.testing.assert_close(torch.cat(step([shared], token)), torch.cat(step(separate, token)), atol=1e-5,
                                   rtol=0)
    parts = shared.split([[0, 1, 2, 3], [4], [5, 7], []])  # the last batch's middle row drops out
    separate[2].select([0, 2])
    for part, alone in zip(parts[:3], separate):
        assert_consistent(part)
        assert part.attention_mask.shape[1] == alone.attention_mask.shape[1]  # the shared padding is gone
    assert len(parts[3].next_position) == 0
    for token in (9, 10):
        torch.testing.assert_close(torch.cat(step(parts[:3], token)), torch.cat(step(separate, token)), atol=1e-5,
                                   rtol=0)

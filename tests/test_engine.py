"""HF engine on a tiny real Llama: KV-cache decoding, batching, pruning, counters."""

import torch

from pipeline.decoding.sampling import SamplingParams
from pipeline.engines.hf import HFEngine

SAMPLE = SamplingParams(max_new_tokens=12)
GREEDY = SamplingParams(max_new_tokens=10, temperature=0)


def ids(engine, text):
    return engine.tokenizer(text).input_ids


def test_greedy_matches_hf_generate_with_left_padding(engine):
    short, long = ids(engine, "Write a review"), ids(engine, "Tell me if the battery lasts well in the cold")
    rows = engine.generate([short, long], 1, [0, 1], GREEDY)
    for prompt, row in zip([short, long], rows):
        out = engine.model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                    pad_token_id=engine.pad_id, eos_token_id=None)
        assert row.token_ids == out[0, len(prompt):].tolist()


def test_rows_do_not_depend_on_batch_company(engine):
    a, b = ids(engine, "Write a review of the lamp"), ids(engine, "Explain why the phone broke so quickly today")
    alone = engine.generate([a], 3, [11, 12, 13], SAMPLE)
    mixed = engine.generate([b, a], 3, [21, 22, 23, 11, 12, 13], SAMPLE)
    assert [r.token_ids for r in alone] == [r.token_ids for r in mixed[3:]]
    again = engine.generate([a], 3, [11, 12, 13], SAMPLE)
    assert [r.token_ids for r in alone] == [r.token_ids for r in again]
    assert len({tuple(r.token_ids) for r in alone}) == 3  # different seeds, different samples


def test_pruned_rows_leave_the_batch_and_kept_rows_continue_unchanged(engine):
    prompt = ids(engine, "Describe how the blender works")
    seeds = [5, 6, 7, 8]
    full = engine.generate([prompt], 4, seeds, SAMPLE)
    assert all(len(r.token_ids) == 12 for r in full)  # precondition: no row hits EOS with these seeds
    engine.open("prune", [prompt], 4, seeds, SAMPLE)
    first = engine.extend("prune", until=4)
    assert [len(r.token_ids) for r in first] == [4, 4, 4, 4]
    before = engine.sessions["prune"].cache.get_seq_length()
    rest = engine.extend("prune", until=12, keep=[1, 3])
    state = engine.sessions.get("prune")
    assert [r.row for r in rest] == [1, 3]
    assert [r.token_ids for r in rest] == [full[1].token_ids, full[3].token_ids]
    assert state.rows == [] and before > 0
    counters = engine.close("prune")
    # 4 rows x 4 tokens, then 2 rows x 8 tokens; 1 prefill + 3 + 8 decode steps.
    assert counters == {"generated_tokens": 4 * 4 + 2 * 8, "forward_passes": 1 + 3 + 8}


def test_kv_cache_shrinks_with_pruning(engine):
    prompt = ids(engine, "Tell me if the camera is good")
    engine.open("shrink", [prompt], 6, list(range(6)), SAMPLE)
    engine.extend("shrink", until=3)
    engine.extend("shrink", until=5, keep=[0, 2])
    key = engine.sessions["shrink"].cache.layers[0].keys
    assert key.shape[0] == 2  # [B, heads, L, head_dim]
    engine.close("shrink")


def test_eos_stops_a_row_and_is_not_in_the_text(tiny_models):
    engine = HFEngine.from_pretrained(str(tiny_models["generator"]))
    prompt = ids(engine, "Write a review")
    greedy = engine.generate([prompt], 1, [0], GREEDY)[0].token_ids
    engine.model.generation_config.eos_token_id = greedy[3]  # the 4th greedy token now ends the response
    engine = HFEngine(engine.model, engine.tokenizer)
    row = engine.generate([prompt], 1, [0], GREEDY)[0]
    assert row.finished and row.token_ids == greedy[:3]
    assert engine.generated_tokens == 4  # the EOS token was generated, then the row left the batch
    fixed = engine.generate([prompt], 1, [0], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))[0]
    assert fixed.token_ids == greedy  # ignore_eos: the EOS token is kept and decoding runs to the cap

"""The data layer across its modules: prompt reading and validation (readers, prompts), prompt
formatting (chat), pair selection (pairs), and empty shards read back by `datasets`."""

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data.pairs import select_pair
from pipeline.data.chat import PromptFormatter, PromptRow, prompt_id
from pipeline.data.prompts import validate
from pipeline.data.readers import PromptSource, read_raw_rows
from pipeline.errors import InputError
from pipeline.data.store import OutputStore
from pipeline.decoding.domain import Candidate, PromptInput, PromptResult
from tests.conftest import MIXED_BAD_ROWS, MIXED_ROWS, write_jsonl


def test_validate_sorts_good_rows_from_rejects(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", MIXED_ROWS)
    rows, rejects = validate(read_raw_rows(str(path), "prompt"), "prompt")
    assert [r.source_row for r in rows] == [0, 2, 4, 6, 9, 11]
    assert {r.source_row: r.reason for r in rejects}.keys() == MIXED_BAD_ROWS.keys()
    for r in rejects:
        assert r.reason.startswith(MIXED_BAD_ROWS[r.source_row])
    assert rows[0].prompt == MIXED_ROWS[0]["prompt"]


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, "", '{"prompt": "b"', {"prompt": "c"}])
    with pytest.raises(InputError, match=r"bad\.jsonl:3: malformed JSON"):
        read_raw_rows(str(path), "prompt")


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        read_raw_rows(str(tmp_path / "missing.jsonl"), "prompt")
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c"] * 200}), good)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(InputError, match="truncated.parquet: unreadable Parquet"):
        read_raw_rows(str(truncated), "prompt")
    with pytest.raises(InputError, match="no column 'text'"):
        read_raw_rows(str(good), "text")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InputError, match="unsupported input format"):
        read_raw_rows(str(tmp_path / "notes.txt"), "prompt")


def test_parquet_directory_and_saved_dataset(tmp_path):
    import datasets

    d = tmp_path / "dir"
    d.mkdir()
    pq.write_table(pa.table({"prompt": ["a", "b"]}), d / "0.parquet")
    pq.write_table(pa.table({"prompt": ["c", None]}), d / "1.parquet")
    assert read_raw_rows(str(d), "prompt") == ["a", "b", "c", None]
    datasets.Dataset.from_dict({"question": ["x", "y"]}).save_to_disk(str(tmp_path / "saved"))
    assert read_raw_rows(str(tmp_path / "saved"), "question") == ["x", "y"]


def test_formatter_truncates_or_rejects_long_prompts(engine):
    long = "Write a review of the lamp and the camera and the battery. " * 20
    row = PromptRow(3, long)
    fmt = PromptFormatter(engine.tokenizer, max_prompt_tokens=40, overlength="truncate")
    prompt, reject, truncated = fmt.prepare(row)
    assert reject is None and truncated
    assert len(prompt.token_ids) <= 40 and prompt.prompt_id == prompt_id(long)
    assert prompt.text.startswith("<s><|user|>") and prompt.text.endswith("<|assistant|>")
    assert long.rstrip().endswith(prompt.raw_prompt.rstrip()[-20:])  # the end of the request survives
    prompt, reject, truncated = PromptFormatter(engine.tokenizer, 40, "reject").prepare(row)
    assert prompt is None and reject.source_row == 3 and "too long" in reject.reason
    short, _, truncated = fmt.prepare(PromptRow(0, "Hi"))
    assert not truncated and short.token_ids == engine.tokenizer(short.text, add_special_tokens=False).input_ids


def result(*cands):
    return PromptResult(PromptInput("pid", "text", "raw", [1]), list(cands), generated_tokens=10,
                        bon_equivalent_tokens=20)


MIXED = (Candidate(0, [1], "a", 0.5, completed=True),
         Candidate(1, [1], "b", 0.9, stopped_early=True, stopped_at=4),  # best score, but unfinished
         Candidate(2, [1], "c", 0.7, completed=True),
         Candidate(3, [1], "d", -0.2, stopped_early=True, stopped_at=4),
         Candidate(4, [1], "e", math.nan, completed=True))


def test_pair_rejected_is_complete_by_default():
    pair, reason = select_pair(result(*MIXED), "sbon")
    assert reason is None and (pair["chosen"], pair["rejected"]) == ("c", "a") and not pair["rejected_is_partial"]
    # min_margin compares final rewards: 0.7 - 0.5
    assert select_pair(result(*MIXED), "sbon", min_margin=0.3)[1].startswith("margin below min_margin")
    only_partial = (MIXED[1], MIXED[2], MIXED[3])
    assert select_pair(result(*only_partial), "sbon")[1] == ("no second distinct completed candidate with a "
                                                             "finite reward")


def test_pair_rejected_may_be_partial_with_rejected_any():
    pair, reason = select_pair(result(*MIXED), "sbon", rejected_from="any")
    assert reason is None
    assert (pair["chosen"], pair["rejected"]) == ("c", "d")
    assert pair["rejected_is_partial"] and pair["failed_candidates"] == 1 and pair["stopped_early"] == 2
    assert pair["num_candidates"] == 5 and pair["generated_tokens"] == 10
    # a partial reward is not a final one: min_margin does not filter this pair
    assert select_pair(result(*MIXED), "sbon", min_margin=5.0, rejected_from="any")[1] is None


def test_pair_rejects_with_reasons():
    assert select_pair(result(Candidate(0, [1], "a", math.nan, completed=True),
                              Candidate(1, [1], "b", 0.2, stopped_early=True)), "s")[1].startswith("no completed")
    assert select_pair(result(Candidate(0, [1], "a", 0.3, completed=True),
                              Candidate(1, [1], "a", 0.1, completed=True)), "s")[1].startswith("no second")
    assert select_pair(result(Candidate(0, [1], "a", 0.3, completed=True),
                              Candidate(1, [1], "b", 0.3, completed=True)), "s")[1].startswith("tie")


def test_empty_shards_do_not_break_load_dataset(tmp_path):
    import datasets

    store = OutputStore(str(tmp_path))
    row = {"prompt_id": "x", "prompt": "p", "chosen": "a", "rejected": "b", "chosen_score": 1.0,
           "rejected_score": 0.0, "strategy": "sbon", "num_candidates": 2, "generated_tokens": 3}
    store.commit_shard(0, [], [], "fp0", "cfg")
    store.commit_shard(1, [row], [], "fp1", "cfg")
    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "train-*.parquet"), split="train")
    assert ds["chosen"] == ["a"]


def test_min_margin_drops_close_pairs_with_a_reason():
    close = result(Candidate(0, [1], "a", 0.50, completed=True), Candidate(1, [1], "b", 0.45, completed=True))
    assert select_pair(close, "s", min_margin=0.04)[0]["chosen"] == "a"
    pair, reason = select_pair(close, "s", min_margin=0.1)
    assert pair is None and reason == "margin below min_margin (0.05 < 0.1)"


def test_a_json_file_holding_an_array_is_read_as_rows(tmp_path):
    # Before: the array was one "line", one reject ("row is not a JSON object"), and its prompts vanished.
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b", "id": 2}, {"text": "no prompt"}, "not an object"],
                               indent=2))
    values = read_raw_rows(str(path), "prompt")
    rows, rejects = validate(values, "prompt")
    assert [r.prompt for r in rows] == ["a", "b"]
    assert [(r.source_row, r.reason.split(" (")[0]) for r in rejects] == [(2, "missing prompt"),
                                                                         (3, "row is not a JSON object")]
    # A .json file of JSON lines stays JSONL; a broken array names the file and its line.
    write_jsonl(tmp_path / "lines.json", [{"prompt": "c"}, {"prompt": "d"}])
    assert read_raw_rows(str(tmp_path / "lines.json"), "prompt") == ["c", "d"]
    (tmp_path / "broken.json").write_text('[\n{"prompt": "a"},\n{"prompt": }\n]')
    with pytest.raises(InputError, match=r"broken\.json:3: malformed JSON"):
        read_raw_rows(str(tmp_path / "broken.json"), "prompt")


def test_a_directory_input_reads_what_it_can_and_names_what_it_skips(tmp_path):
    # Before: the hidden file was read as input; the .csv and .txt were dropped without a word.
    d = tmp_path / "in"
    (d / ".ipynb_checkpoints").mkdir(parents=True)
    write_jsonl(d / "a.jsonl", [{"prompt": "a"}])
    (d / "b.json").write_text(json.dumps([{"prompt": "b"}]))
    write_jsonl(d / ".hidden.jsonl", [{"prompt": "hidden"}])
    write_jsonl(d / ".ipynb_checkpoints" / "a-checkpoint.jsonl", [{"prompt": "copy"}])
    (d / "c.csv").write_text("prompt\nc\n")
    (d / "notes.txt").write_text("x")
    source = PromptSource(str(d), "prompt")
    assert list(source.values()) == ["a", "b"]
    assert source.skipped == {".hidden.jsonl": "hidden file", ".ipynb_checkpoints/a-checkpoint.jsonl": "hidden file",
                              "c.csv": "other format, not .jsonl/.json/.parquet",
                              "notes.txt": "other format, not .jsonl/.json/.parquet"}
    note = source.skipped_note()
    assert "\n" not in note and "4 file(s) not read" in note and "c.csv" in note
    assert PromptSource(str(d / "a.jsonl"), "prompt").skipped_note() is None


def test_a_jsonl_file_without_the_prompt_column_fails_like_parquet(tmp_path):
    # Before: every row became a "missing prompt" reject and the build exited 0.
    write_jsonl(tmp_path / "wrong.jsonl", [{"question": "a"}, {"question": "b"}])
    with pytest.raises(InputError, match=r"wrong\.jsonl: no row has the column 'prompt'.*question"):
        read_raw_rows(str(tmp_path / "wrong.jsonl"), "prompt")
    (tmp_path / "wrong.json").write_text(json.dumps([{"question": "a"}]))
    with pytest.raises(InputError, match=r"wrong\.json: no row has the column 'prompt'"):
        read_raw_rows(str(tmp_path / "wrong.json"), "prompt")
    # Some rows without it: only those are rejected.
    write_jsonl(tmp_path / "some.jsonl", [{"question": "a"}, {"prompt": "b"}])
    rows, rejects = validate(read_raw_rows(str(tmp_path / "some.jsonl"), "prompt"), "prompt")
    assert [r.prompt for r in rows] == ["b"] and [r.source_row for r in rejects] == [0]
    write_jsonl(tmp_path / "empty.jsonl", [])
    assert read_raw_rows(str(tmp_path / "empty.jsonl"), "prompt") == []


def test_pair_lists_every_candidate_by_sample_index_with_candidate_scores():
    shuffled = (MIXED[2], MIXED[4], MIXED[0], MIXED[3], MIXED[1])
    pair, _ = select_pair(result(*shuffled), "sbon", candidates=True)
    scores = pair["candidate_scores"]
    assert scores[:4] == [0.5, 0.9, 0.7, -0.2] and math.isnan(scores[4])
    assert pair["candidate_tokens"] == [1] * 5
    assert pair["candidate_stopped_early"] == [False, True, False, True, False]
    assert "candidate_scores" not in select_pair(result(*shuffled), "sbon")[0]

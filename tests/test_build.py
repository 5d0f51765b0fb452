"""The build job in-process (runtime.local=true): counts, rejects, manifest, resume, CLI errors."""

import json
import subprocess
import sys

import datasets
import pyarrow.parquet as pq
import pytest

from jobs.build_dataset import main
from tests.conftest import GOOD_PROMPTS, MIXED_BAD_ROWS, MIXED_ROWS, write_jsonl


def build_args(tiny_models, prompts, output, *extra, tau=8):
    sbon = ["--set", f"strategy.decision_token={tau}"] if tau else []
    return [*sbon, "--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(output),
            "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
            "--set", "runtime.local=true", "--max-new-tokens", "24", "--num-samples", "4",
            "--set", "data.shard_size=5", "--no-progress", *extra]


@pytest.fixture(scope="module")
def mixed_build(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("build")
    prompts = write_jsonl(tmp / "mixed.jsonl", MIXED_ROWS)
    assert main(build_args(tiny_models, prompts, tmp / "out")) == 0
    return tmp / "out", prompts


def test_one_pair_per_good_prompt_and_every_bad_row_rejected(mixed_build):
    out, _ = mixed_build
    pairs = datasets.load_dataset("parquet", data_files=str(out / "part-*.parquet"), split="train")
    assert sorted(pairs["raw_prompt"]) == sorted(GOOD_PROMPTS)
    assert len(set(pairs["prompt_id"])) == len(GOOD_PROMPTS)
    assert sorted(pairs["source_row"]) == [0, 2, 4, 6, 9, 11]
    rejects = datasets.load_dataset("parquet", data_files=str(out / "_rejects" / "*.parquet"), split="train")
    assert sorted(rejects["source_row"]) == sorted(MIXED_BAD_ROWS)
    for row, reason in zip(rejects["source_row"], rejects["reason"]):
        assert reason.startswith(MIXED_BAD_ROWS[row])
    assert set(rejects["stage"]) == {"input"}


def test_output_contract_columns_and_manifest(mixed_build):
    out, _ = mixed_build
    table = pq.read_table(out / "part-00000.parquet")
    types = {f.name: str(f.type) for f in table.schema}
    for col, typ in {"prompt_id": "string", "prompt": "string", "chosen": "string", "rejected": "string",
                     "chosen_score": "double", "rejected_score": "double", "strategy": "string",
                     "num_candidates": "int64", "generated_tokens": "int64"}.items():
        assert types[col] == typ, col
    rows = table.to_pylist()
    assert all(r["chosen_score"] > r["rejected_score"] and r["num_candidates"] == 4 for r in rows)
    assert all(r["strategy"] == "sbon" and not r["chosen"].endswith("</s>") for r in rows)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["prompts_in"] == len(MIXED_ROWS)
    assert manifest["pairs"] == len(GOOD_PROMPTS)
    assert manifest["prompts_rejected"] == len(MIXED_BAD_ROWS)
    assert manifest["generated_tokens"] < manifest["bon_equivalent_tokens"]
    assert manifest["config"]["strategy"]["decision_token"] == 8
    assert manifest["wall_seconds"] > 0 and manifest["shards"] == 3


def test_rerun_skips_committed_shards(mixed_build, tiny_models):
    out, prompts = mixed_build
    before = (out / "part-00001.parquet").stat().st_mtime_ns
    assert main(build_args(tiny_models, prompts, out)) == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["shards_skipped"] == [0, 1, 2] and manifest["pairs"] == len(GOOD_PROMPTS)
    assert (out / "part-00001.parquet").stat().st_mtime_ns == before


def test_best_of_n_strategy_spends_full_budget(tiny_models, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:3]])
    assert main(build_args(tiny_models, prompts, tmp_path / "out", "--strategy", "best_of_n", tau=None)) == 0
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    assert manifest["pairs"] == 3
    assert manifest["generated_tokens"] == manifest["bon_equivalent_tokens"]


def test_overlength_reject_mode_records_reason(tiny_models, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": GOOD_PROMPTS[0]}, {"prompt": "very long " * 400}])
    assert main(build_args(tiny_models, prompts, tmp_path / "out", "--set", "data.overlength=reject")) == 0
    rejects = pq.read_table(tmp_path / "out" / "_rejects" / "part-00000.parquet").to_pylist()
    assert [r["source_row"] for r in rejects] == [1] and "too long" in rejects[0]["reason"]


@pytest.mark.parametrize("content, needle", [
    (None, "missing.jsonl: no such file"),
    ('{"prompt": "a"}\n{"prompt": "b"\n', "bad.jsonl:2: malformed JSON line"),
    (b"PAR1 not really parquet", "bad.parquet: unreadable Parquet file"),
])
def test_cli_bad_input_exits_2_with_one_line(tiny_models, tmp_path, content, needle):
    name = "missing.jsonl" if content is None else ("bad.parquet" if isinstance(content, bytes) else "bad.jsonl")
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "jobs.build_dataset", *build_args(tiny_models, path, tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "o" / "part-00000.parquet").exists()


def test_cli_config_errors_exit_2(tiny_models, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jobs.build_dataset", "--config", "configs/demo.yaml",
                           "--set", "strategy.rejection_rat=0.5"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "strategy.rejection_rat" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "jobs.build_dataset", "--config", "configs/demo.yaml",
                           "--set", f"models.generator={tmp_path}/nope", "--output", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "models.generator" in proc.stderr and "Traceback" not in proc.stderr

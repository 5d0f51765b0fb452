"""s3:// input and output against a real S3 protocol server (moto on 127.0.0.1), in-process build."""

import json

import pytest

moto_server = pytest.importorskip("moto.server")

from jobs.build_dataset import main  # noqa: E402
from pipeline.training.dpo import load_pairs  # noqa: E402
from tests.conftest import GOOD_PROMPTS, MIXED_BAD_ROWS, MIXED_ROWS  # noqa: E402


def test_build_reads_and_writes_s3(s3, tiny_models):
    fs, options = s3
    with fs.open("bucket/in/prompts.jsonl", "w") as f:
        f.write("\n".join(json.dumps(r) for r in MIXED_ROWS) + "\n")
    storage = json.dumps(options)
    rc = main(["--config", "configs/demo.yaml", "--prompts", "s3://bucket/in/prompts.jsonl",
               "--output", "s3://bucket/out/run-1", "--set", f"data.storage_options={storage}",
               "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
               "--set", "runtime.local=true", "--num-samples", "4", "--max-new-tokens", "12",
               "--set", "strategy.decision_token=4", "--set", "data.shard_size=5", "--no-progress"])
    assert rc == 0
    fs.invalidate_cache()
    assert sorted(fs.ls("bucket/out/run-1", detail=False)) == [
        "bucket/out/run-1/README.md", "bucket/out/run-1/_SUCCESS", "bucket/out/run-1/_manifest.json",
        "bucket/out/run-1/_markers",
        "bucket/out/run-1/_quarantine", "bucket/out/run-1/_rejects", "bucket/out/run-1/_report.json",
        "bucket/out/run-1/train-00000.parquet", "bucket/out/run-1/train-00001.parquet",
        "bucket/out/run-1/train-00002.parquet"]
    assert len(fs.ls("bucket/out/run-1/_markers")) == 3
    manifest = json.loads(fs.cat("bucket/out/run-1/_manifest.json"))
    assert manifest["pairs"] == len(GOOD_PROMPTS) and manifest["prompts_rejected"] == len(MIXED_BAD_ROWS)
    pairs = load_pairs("s3://bucket/out/run-1", options)
    assert sorted(pairs.column_names) == ["chosen", "prompt", "rejected"] and pairs.num_rows == len(GOOD_PROMPTS)

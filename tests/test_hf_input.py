"""Hugging Face datasets as input (issue 30, item 7): ``save_to_disk`` directories (a Dataset's, a
DatasetDict's split) and Hub datasets (``hf://datasets/ORG/NAME`` with data.subset, data.split,
data.revision), read through the real ``datasets`` code, offline.

The Hub dataset is a real cache on disk, the one an online ``load_dataset("org/name", name)`` leaves
in HF_DATASETS_CACHE: ``org___name/<config>/0.0.0/<commit>/name-<split>.arrow`` and its
dataset_info.json. Offline (HF_HUB_OFFLINE=1), datasets 5 never asks the Hub nor the hub file cache
(HF_HUB_CACHE's snapshots): ``dataset_module_factory`` raises OfflineModeIsEnabled before its
``hf_hub_download`` and falls back to that datasets cache (``CachedDatasetModuleFactory``), which
is what these tests exercise. The cache is written by preparing a local copy of the repo (README
with two configs, Parquet files) with ``load_dataset``, then placed where the Hub copy goes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.build_dataset import main
from pipeline.config import ConfigError, load_config
from pipeline.data.readers import PromptSource, hub_dataset_id
from pipeline.errors import InputError
from tests.conftest import GOOD_PROMPTS, write_jsonl

COMMIT = "0123456789abcdef0123456789abcdef01234567"
"""The Hub commit the cached copy stands for (the last directory of an online load's cache)."""

# Good rows and bad ones (blank, missing, a duplicate), each with a topic column.
ROWS = [
    {"prompt": GOOD_PROMPTS[0], "topic": "lamp"},
    {"prompt": "   ", "topic": "blank"},
    {"prompt": GOOD_PROMPTS[1], "topic": "battery"},
    {"prompt": None, "topic": "missing"},
    {"prompt": GOOD_PROMPTS[2], "topic": "blender"},
    {"prompt": GOOD_PROMPTS[0], "topic": "duplicate"},
    {"prompt": GOOD_PROMPTS[3], "topic": "camera"},
]
TEST_ROWS = [{"prompt": GOOD_PROMPTS[4], "topic": "app"}, {"prompt": GOOD_PROMPTS[5], "topic": "delivery"}]
ALT_ROWS = [{"question": GOOD_PROMPTS[5]}, {"question": GOOD_PROMPTS[4]}]


def table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows)


def columns(rows: list[dict]) -> dict[str, list]:
    return {key: [r[key] for r in rows] for key in rows[0]}


def make_hub_cache(root: Path) -> Path:
    """HF_DATASETS_CACHE holding hf://datasets/org/name as an online load of both its subsets
    leaves it: subset default (splits train, test; columns prompt, topic) and alt (train; question)."""
    repo, cache = root / "repo" / "name", root / "datasets-cache"
    (repo / "data").mkdir(parents=True)
    (repo / "alt").mkdir()
    pq.write_table(table(ROWS), repo / "data" / "train-00000-of-00001.parquet")
    pq.write_table(table(TEST_ROWS), repo / "data" / "test-00000-of-00001.parquet")
    pq.write_table(table(ALT_ROWS), repo / "alt" / "train-00000-of-00001.parquet")
    (repo / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n"
        "  - split: test\n    path: data/test-*\n"
        "- config_name: alt\n  data_files:\n  - split: train\n    path: alt/train-*\n---\n")
    for subset in ("default", "alt"):
        datasets.load_dataset(str(repo), name=subset, cache_dir=str(cache))
    # A Hub dataset's cache directory is named ORG___NAME, and its last level is the commit.
    shutil.move(cache / "name", cache / "org___name")
    for prepared in (cache / "org___name").glob("*/0.0.0/*"):
        if prepared.is_dir():
            prepared.rename(prepared.parent / COMMIT)
    return cache


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    return make_hub_cache(tmp_path_factory.mktemp("hub"))


def offline_env(cache: Path, home: Path) -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(home),
            "HF_DATASETS_CACHE": str(cache)}


def go_offline(mp: pytest.MonkeyPatch, cache: Path, home: Path) -> None:
    """The environment of an offline machine with that cache; datasets and huggingface_hub read
    these variables when first imported, so their module constants are set too."""
    for key, value in offline_env(cache, home).items():
        mp.setenv(key, value)
    mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def offline(hub_cache, tmp_path, monkeypatch):
    go_offline(monkeypatch, hub_cache, tmp_path / "hf-home")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A Dataset of ROWS saved in 3 shards, and a DatasetDict: train (TEST_ROWS) and eval (ROWS)."""
    root = tmp_path_factory.mktemp("saved")
    datasets.Dataset.from_dict(columns(ROWS)).save_to_disk(str(root / "dataset"), num_shards=3)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(columns(TEST_ROWS)),
                          "eval": datasets.Dataset.from_dict(columns(ROWS))}).save_to_disk(str(root / "dict"))
    return {"dataset": root / "dataset", "dict": root / "dict"}


def read(uri, column="prompt", **kwargs) -> list[tuple]:
    return list(PromptSource(str(uri), column, **kwargs).records())


def plain(rows: list[dict], column: str = "prompt") -> list[tuple]:
    return [(r[column], {}) for r in rows]


def with_topic(rows: list[dict]) -> list[tuple]:
    return [(r["prompt"], {"topic": r["topic"]}) for r in rows]


# -- save_to_disk directories ---------------------------------------------------------------------

def test_saved_dataset_and_datasetdict_split_read_in_order(saved, tmp_path):
    assert read(saved["dataset"]) == plain(ROWS)
    assert read(saved["dataset"], extra_columns=None) == with_topic(ROWS)
    assert read(saved["dict"]) == plain(TEST_ROWS)  # data.split defaults to train
    assert read(saved["dict"], split="eval", extra_columns=["topic"]) == with_topic(ROWS)
    source = PromptSource(str(saved["dict"]), "prompt", split="eval")
    assert source.provenance["kind"] == "saved_dataset" and source.provenance["split"] == "eval"
    state = json.loads((saved["dict"] / "eval" / "state.json").read_text())
    assert source.provenance["fingerprint"] == state["_fingerprint"]
    # Shard by shard: 7 rows in shards of 3 across the Dataset's three files.
    assert [(k, v) for k, v in PromptSource(str(saved["dataset"]), "prompt").shards(3)] == [
        (0, [r["prompt"] for r in ROWS[:3]]), (1, [r["prompt"] for r in ROWS[3:6]]), (2, [ROWS[6]["prompt"]])]


def test_saved_dataset_errors_name_the_key_or_file(saved, tmp_path):
    with pytest.raises(InputError, match=r"^data\.split: .*dict has no split 'validation' \(splits: train, eval\)$"):
        PromptSource(str(saved["dict"]), "prompt", split="validation")
    with pytest.raises(InputError, match=r"^data\.prompt_column: .*dataset: no column 'question' "
                                         r"\(columns: prompt, topic\)$"):
        PromptSource(str(saved["dataset"]), "question")
    with pytest.raises(InputError, match=r"^data\.split: .* is a saved Dataset, not a DatasetDict"):
        PromptSource(str(saved["dataset"]), "prompt", split="test")
    with pytest.raises(InputError, match=r"no column 'nope' \(data\.extra_columns\)$"):
        read(saved["dataset"], extra_columns=["nope"])
    with pytest.raises(InputError, match=r"^data\.subset: applies to a Hub dataset"):
        PromptSource(str(saved["dataset"]), "prompt", subset="default")
    jsonl = write_jsonl(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(InputError, match=r"^data\.split: .*p\.jsonl has no splits"):
        PromptSource(str(jsonl), "prompt", split="test")
    broken = tmp_path / "broken"
    shutil.copytree(saved["dataset"], broken)
    (broken / "state.json").write_text("{not json")
    with pytest.raises(InputError, match=r"broken/state\.json: unreadable saved dataset state"):
        PromptSource(str(broken), "prompt")
    (broken / "state.json").write_text((saved["dataset"] / "state.json").read_text())
    (broken / "data-00001-of-00003.arrow").unlink()
    with pytest.raises(InputError, match=r"data-00001-of-00003\.arrow: no such file"):
        read(broken)


# -- Hub datasets ---------------------------------------------------------------------------------

def test_hub_ids_and_local_paths_are_never_confused(tmp_path, monkeypatch):
    assert hub_dataset_id("hf://datasets/org/name") == "org/name"
    assert hub_dataset_id("hf://datasets/org/name/") == "org/name"
    assert hub_dataset_id("hf://datasets/org/name/data/train.parquet") is None  # a file: read through fsspec
    assert hub_dataset_id("org/name") is None and hub_dataset_id("s3://org/name") is None
    with pytest.raises(InputError, match=r"^data\.prompts: .*give the revision as data\.revision"):
        hub_dataset_id("hf://datasets/org/name@v1")
    # A relative path that looks like a Hub id is a path.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    write_jsonl(tmp_path / "org" / "name" / "prompts.jsonl", ROWS)
    assert read("org/name") == plain(ROWS)


def test_hub_dataset_split_subset_and_columns(offline):
    assert read("hf://datasets/org/name", subset="default") == plain(ROWS)
    assert read("hf://datasets/org/name", subset="default", split="test", extra_columns=None) == with_topic(TEST_ROWS)
    assert read("hf://datasets/org/name", "question", subset="alt") == plain(ALT_ROWS, "question")
    source = PromptSource("hf://datasets/org/name", "prompt", subset="default", split="test", revision=COMMIT)
    assert source.provenance == {"kind": "hub", "dataset": "org/name", "subset": "default", "split": "test",
                                 "revision": COMMIT, "commit": COMMIT}
    # Read twice (the build plans, then runs): the same rows, the same shards.
    assert list(source.shards(1)) == list(source.shards(1)) == [(0, [TEST_ROWS[0]["prompt"]]),
                                                                (1, [TEST_ROWS[1]["prompt"]])]


@pytest.mark.parametrize("uri,kwargs,error", [
    ("hf://datasets/org/missing", {}, r"^data\.prompts: hf://datasets/org/missing: Couldn't reach 'org/missing' "
                                       r"on the Hub \(OfflineModeIsEnabled\)"),
    ("hf://datasets/org/name", {"subset": "nope"}, r"^data\.subset: .*config 'nope'"),
    ("hf://datasets/org/name", {}, r"^data\.subset: .*multiple 'org/name' configurations in the cache: default, alt"),
    ("hf://datasets/org/name", {"subset": "default", "split": "validation"},
     r"^data\.split: hf://datasets/org/name has no split 'validation' \(splits: train, test\)$"),
    ("hf://datasets/org/name", {"subset": "alt"},
     r"^data\.prompt_column: hf://datasets/org/name: no column 'prompt' \(columns: question\)$"),
    ("hf://datasets/org/name", {"subset": "default", "revision": "f" * 40},
     rf"^data\.revision: .*commit {'f' * 40} asked for, but the copy found is commit {COMMIT}"),
])
def test_hub_dataset_errors_name_the_key(offline, uri, kwargs, error):
    with pytest.raises(InputError, match=error) as caught:
        PromptSource(uri, "prompt", **kwargs)
    assert "\n" not in str(caught.value)


def test_hub_dataset_extra_column_missing_is_named(offline):
    with pytest.raises(InputError, match=r"no column 'nope' \(data\.extra_columns\)"):
        read("hf://datasets/org/name", subset="default", extra_columns=["nope"])


def test_config_keys():
    data = load_config(None, ["data.prompts=hf://datasets/org/name"]).data
    assert (data.split, data.subset, data.revision) == ("train", None, None)
    data = load_config(None, ["data.prompts=hf://datasets/org/name", "data.subset=alt", "data.split=test",
                              "data.revision=v1"]).data
    assert (data.split, data.subset, data.revision) == ("test", "alt", "v1")
    with pytest.raises(ConfigError, match=r"^data\.subset: applies to a Hub dataset .* not to prompts\.jsonl$"):
        load_config(None, ["data.prompts=prompts.jsonl", "data.subset=alt"])
    with pytest.raises(ConfigError, match=r"^data\.revision: applies to a Hub dataset"):
        load_config(None, ["data.prompts=prompts.jsonl", "data.revision=v1"])
    with pytest.raises(ConfigError, match=r"^data\.split: must name a split"):
        load_config(None, ["data.split="])


# -- builds: each input kind gives the JSONL input's pairs and rejects ---------------------------

def build_args(tiny_models, prompts, output, *extra) -> list[str]:
    return ["--set", "strategy.decision_token=8", "--config", "configs/demo.yaml", "--prompts", str(prompts),
            "--output", str(output), "--set", f"models.generator={tiny_models['generator']}",
            "--set", f"models.reward={tiny_models['reward']}", "--set", "runtime.local=true",
            "--max-new-tokens", "12", "--num-samples", "3", "--set", "data.shard_size=3", "--no-progress", *extra]


def outcome(out: Path) -> tuple[list[dict], list[tuple], dict]:
    """(pairs, (source_row, reason) of each reject, the manifest's counts) of a build."""
    pairs = sorted((r for part in sorted(out.glob("*.parquet")) for r in pq.read_table(part).to_pylist()),
                   key=lambda r: r["source_row"])
    keep = ("source_row", "prompt_id", "prompt", "chosen", "rejected", "chosen_score", "rejected_score",
            "generated_tokens", "topic")
    rejects = sorted((r["source_row"], r["reason"]) for part in sorted((out / "_rejects").glob("*.parquet"))
                     for r in pq.read_table(part).to_pylist())
    manifest = json.loads((out / "_manifest.json").read_text())
    counts = {k: manifest[k] for k in ("prompts_in", "prompts_rejected", "pairs", "generated_tokens")}
    return [{k: r.get(k) for k in keep} for r in pairs], rejects, counts


@pytest.fixture(scope="module")
def jsonl_build(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("jsonl-build")
    assert main(build_args(tiny_models, write_jsonl(tmp / "prompts.jsonl", ROWS), tmp / "out",
                           "--set", "data.extra_columns=[topic]")) == 0
    return outcome(tmp / "out")


def test_jsonl_reference_build(jsonl_build):
    pairs, rejects, counts = jsonl_build
    assert [p["source_row"] for p in pairs] == [0, 2, 4, 6]
    assert [p["topic"] for p in pairs] == ["lamp", "battery", "blender", "camera"]
    assert [row for row, _ in rejects] == [1, 3, 5]
    assert counts["prompts_in"] == len(ROWS) and counts["pairs"] == 4 and counts["prompts_rejected"] == 3


def test_saved_dataset_and_datasetdict_builds_equal_the_jsonl_build(jsonl_build, saved, tiny_models, tmp_path):
    assert main(build_args(tiny_models, saved["dataset"], tmp_path / "dataset", "--set",
                           "data.extra_columns=[topic]")) == 0
    assert outcome(tmp_path / "dataset") == jsonl_build
    # The DatasetDict's split eval holds ROWS (its train split, data.split's default, does not).
    assert main(build_args(tiny_models, saved["dict"], tmp_path / "dict", "--set", "data.extra_columns=[topic]",
                           "--set", "data.split=eval")) == 0
    assert outcome(tmp_path / "dict") == jsonl_build
    manifest = json.loads((tmp_path / "dict" / "_manifest.json").read_text())
    assert manifest["input"]["kind"] == "saved_dataset" and manifest["input"]["split"] == "eval"


def test_hub_dataset_build_equals_the_jsonl_build(jsonl_build, hub_cache, tiny_models, tmp_path, monkeypatch):
    go_offline(monkeypatch, hub_cache, tmp_path / "hf-home")
    assert main(build_args(tiny_models, "hf://datasets/org/name", tmp_path / "hub", "--set", "data.subset=default",
                           "--set", "data.extra_columns=[topic]")) == 0
    assert outcome(tmp_path / "hub") == jsonl_build
    manifest = json.loads((tmp_path / "hub" / "_manifest.json").read_text())
    assert manifest["input"] == {"kind": "hub", "dataset": "org/name", "subset": "default", "split": "train",
                                 "revision": None, "commit": COMMIT}
    # A rerun resumes: every shard's fingerprint matches the committed one (the same rows, read again).
    assert main(build_args(tiny_models, "hf://datasets/org/name", tmp_path / "hub", "--set", "data.subset=default",
                           "--set", "data.extra_columns=[topic]")) == 0
    report = json.loads((tmp_path / "hub" / "_report.json").read_text())
    assert report["shards_written"] == 0 and report["shards_skipped"] == 3


@pytest.mark.parametrize("prompts,settings,error", [
    ("hf://datasets/org/missing", [], "error: data.prompts: hf://datasets/org/missing: Couldn't reach"),
    ("hf://datasets/org/name", ["data.subset=default", "data.split=validation"],
     "error: data.split: hf://datasets/org/name has no split 'validation' (splits: train, test)"),
    ("hf://datasets/org/name", ["data.subset=nope"], "error: data.subset: hf://datasets/org/name:"),
    ("hf://datasets/org/name", ["data.subset=default", "data.prompt_column=question"],
     "error: data.prompt_column: hf://datasets/org/name: no column 'question' (columns: prompt, topic)"),
    ("hf://datasets/org/name", ["data.subset=default", "data.revision=" + "f" * 40], "error: data.revision: "),
])
def test_build_job_exits_2_with_one_line_naming_the_key(offline, tiny_models, tmp_path, capsys, prompts, settings,
                                                        error):
    args = build_args(tiny_models, prompts, tmp_path / "out", *(a for s in settings for a in ("--set", s)))
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(error) and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_build_job_offline_through_the_environment(hub_cache, tiny_models, tmp_path):
    """The job as a user runs it, offline through the real environment variables (read when
    datasets and huggingface_hub are imported): a dataset not in the cache is one line, exit 2."""
    env = {**os.environ, **offline_env(hub_cache, tmp_path / "hf-home"), "OMP_NUM_THREADS": "1"}
    args = build_args(tiny_models, "hf://datasets/org/missing", tmp_path / "out")
    done = subprocess.run([sys.executable, "-m", "jobs.build_dataset", *args], capture_output=True, text=True,
                          env=env, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0] == ("error: data.prompts: hf://datasets/org/missing: Couldn't reach 'org/missing' on the Hub "
                        "(OfflineModeIsEnabled) (ConnectionError)"), done.stderr

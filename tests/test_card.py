"""The build's output read as Hugging Face reads it: the dataset card (README.md) with its configs,
``load_dataset(OUT)`` and ``load_dataset("parquet", data_dir=OUT)`` returning exactly the committed
pairs, the rejects config, a killed build's card, provenance (weights hash, packages, redaction),
the conversational format, and an s3:// output."""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from jobs.build_dataset import main
from pipeline.data.card import CARD_TAG
from pipeline.data.store import OutputStore
from pipeline.errors import OutputConflict
from pipeline.provenance import redact, weights_sha256
from tests.conftest import GOOD_PROMPTS, MIXED_BAD_ROWS, MIXED_ROWS, moto_s3, s3_options, write_jsonl

SECRET = "SECRETcardfake24680"
KEY = "AKIACARDFAKE13579"


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """Each test its own datasets cache: no test reads another's cached Arrow files."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def build_args(tiny_models, prompts, output, *extra) -> list[str]:
    return ["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(output),
            "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
            "--set", "runtime.local=true", "--max-new-tokens", "12", "--num-samples", "4",
            "--set", "strategy.decision_token=4", "--set", "data.shard_size=5", "--no-progress", *extra]


@pytest.fixture(scope="module")
def finished(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("card")
    prompts = write_jsonl(tmp / "mixed.jsonl", MIXED_ROWS)
    assert main(build_args(tiny_models, prompts, tmp / "out")) == 0
    return tmp / "out"


def committed_rows(out) -> list[dict]:
    store = OutputStore(str(out))
    return pa.concat_tables([pq.read_table(p) for p in store.committed_parts(allow_partial=True)]).to_pylist()


def front_matter(out) -> dict:
    text = (out / "README.md").read_text()
    assert text.startswith(f"---\n{CARD_TAG}")
    return yaml.safe_load(text.split("---\n")[1])


def by_row(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: r["source_row"])


def test_load_dataset_reads_exactly_the_committed_pairs_by_card_and_by_file_name(finished):
    expected = by_row(committed_rows(finished))
    assert len(expected) == len(GOOD_PROMPTS)
    through_card = datasets.load_dataset(str(finished), split="train")
    by_name = datasets.load_dataset("parquet", data_dir=str(finished), split="train")
    for loaded in (through_card, by_name):
        assert loaded.column_names == pq.read_schema(finished / "train-00000.parquet").names
        assert by_row(loaded.to_list()) == expected


def test_rejects_config_loads_and_nothing_else_in_the_output_looks_like_a_split(finished):
    rejects = datasets.load_dataset(str(finished), "rejects", split="train")
    assert sorted(rejects["source_row"]) == sorted(MIXED_BAD_ROWS)
    configs = {c["config_name"]: c for c in front_matter(finished)["configs"]}
    assert set(configs) == {"default", "rejects"}  # no quarantined candidate: no quarantine config
    # datasets' split patterns, as load_dataset("parquet", data_dir=OUT) resolves them: pair files only.
    patterns = datasets.data_files.get_data_patterns(str(finished))
    assert list(patterns) == ["train"]
    files = datasets.data_files.DataFilesList.from_patterns(patterns["train"], str(finished))
    assert sorted(f.rsplit("/", 1)[1] for f in files) == [f"train-0000{k}.parquet" for k in range(3)]


def test_card_text_has_counts_columns_and_provenance(finished):
    text = (finished / "README.md").read_text()
    manifest = json.loads((finished / "_manifest.json").read_text())
    assert manifest["dataset_card"] == "README.md"
    assert f"| pairs | {len(GOOD_PROMPTS)} |" in text
    assert "| `chosen_score` | double |" in text and "| `rejected` | string |" in text
    assert 'load_dataset("parquet", data_dir=' in text and "DPOTrainer" in text
    assert manifest["provenance"]["models"]["generator"]["weights_sha256"] in text


def test_provenance_weights_hash_packages_and_config(finished, tiny_models):
    prov = json.loads((finished / "_manifest.json").read_text())["provenance"]
    for role in ("generator", "reward"):
        found = prov["models"][role]
        digest = hashlib.sha256()
        weights = sorted(p for p in tiny_models[role].iterdir() if p.suffix in (".safetensors", ".bin", ".gguf"))
        assert [p.name for p in weights] == found["weights_files"] and weights
        for path in weights:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        assert found == {"model": str(tiny_models[role]), "revision": None, "kind": "local",
                         "weights_sha256": digest.hexdigest(), "weights_files": found["weights_files"],
                         "weights_bytes": sum(p.stat().st_size for p in weights)}
    assert "draft" not in prov["models"]  # configs/demo.yaml names one, but sbon does not load it
    for name in ("python", "torch", "transformers", "ray", "datasets", "trl", "pyarrow", "bon-pipeline"):
        assert prov["packages"][name], name
    assert prov["config"]["strategy"]["decision_token"] == 4 and prov["date"] and prov["command"]


def test_hub_id_without_local_files_and_reward_function(monkeypatch, tmp_path):
    from pipeline.provenance import model_provenance

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    found = model_provenance("some-org/some-model", "v1.0")
    assert found["kind"] == "hub" and found["revision"] == "v1.0" and found["commit"] is None
    assert "nor in the local Hugging Face cache" in found["commit_reason"]
    snapshot = tmp_path / "hub" / "models--some-org--some-model" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("a" * 40)
    assert model_provenance("some-org/some-model", None)["commit"] == "a" * 40
    judge = model_provenance("pipeline.judge:ifeval_reward", None)
    import pipeline.judge

    with open(pipeline.judge.__file__, "rb") as f:
        assert judge["module_sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert model_provenance(None, None) is None


def test_weights_hash_is_cached_per_path_and_follows_a_change(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    (tmp_path / "config.json").write_text("{}")  # not a weight file
    first = weights_sha256(str(tmp_path))
    assert first["weights_sha256"] == hashlib.sha256(b"model.safetensors\0abc").hexdigest()
    (tmp_path / "model.safetensors").write_bytes(b"abcd")
    assert weights_sha256(str(tmp_path))["weights_sha256"] == hashlib.sha256(b"model.safetensors\0abcd").hexdigest()


def test_a_python_m_command_is_recorded_as_typed():
    from pipeline.config import load_config
    from pipeline.provenance import provenance

    config = load_config("configs/demo.yaml", strategy="dsbd")
    prov = provenance(config, ["/somewhere/jobs/build_dataset.py", "--config", "configs/demo.yaml"])
    assert prov["command"] == "python -m jobs.build_dataset --config configs/demo.yaml"
    assert prov["models"]["draft"]["model"] == config.models.draft  # dsbd loads the draft


def test_command_is_redacted():
    options = json.dumps({"endpoint_url": "http://h:9", "key": KEY, "secret": SECRET})
    argv = ["bon-build", "--set", f"data.storage_options={options}", "--hf-token", SECRET, "--max-new-tokens", "24",
            f"--set=data.storage_options.secret={SECRET}", "--prompts", f"s3://{KEY}:{SECRET}@bucket/p.jsonl"]
    command = shlex.join(redact(argv))
    assert SECRET not in command and KEY not in command
    assert "--max-new-tokens 24" in command and "http://h:9" in command


def test_conversational_output_loads(tiny_models, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:4]])
    out = tmp_path / "out"
    assert main(build_args(tiny_models, prompts, out, "--set", "data.output_format=conversational")) == 0
    loaded = datasets.load_dataset(str(out), split="train")
    assert by_row(loaded.to_list()) == by_row(committed_rows(out))
    assert loaded[0]["chosen"][0]["role"] == "assistant" and loaded[0]["prompt"][-1]["role"] == "user"
    assert "(messages)" in (out / "README.md").read_text()


def test_a_killed_build_card_names_only_committed_shards(finished, tmp_path):
    """A build killed after committing shard 0: its card reads shard 0; the pair file of shard 1,
    written under its pending name but with no marker (killed between the two writes), is read by
    neither load_dataset form."""
    out = tmp_path / "out"
    out.mkdir()
    store = OutputStore(str(out))
    store.acquire_lease("cfg")
    store.prepare()
    assert not (out / "README.md").exists()  # nothing committed: no card, ours or stale
    first, second = (pq.read_table(finished / f"train-0000{k}.parquet").to_pylist() for k in (0, 1))
    store.commit_shard(0, first, [], "fp0", "cfg")
    store.release_lease()
    shutil.copy(finished / "train-00001.parquet", out / ".pending-train-00001.parquet")  # no marker
    assert [c["data_files"][0]["path"] for c in front_matter(out)["configs"]] == ["train-*.parquet"]
    for loaded in (datasets.load_dataset(str(out), split="train"),
                   datasets.load_dataset("parquet", data_dir=str(out), split="train")):
        assert by_row(loaded.to_list()) == by_row(committed_rows(out)) and sorted(loaded["prompt_id"]) == sorted(
            r["prompt_id"] for r in first)
    # A resumed run's card names what is committed when it starts, and then each commit (interval 0).
    store = OutputStore(str(out))
    store.CARD_INTERVAL_S = 0.0
    store.acquire_lease("cfg")
    assert store.committed({0: ("fp0", "cfg"), 1: ("fp1", "cfg")}) == {0}
    store.prepare()
    store.commit_shard(1, second, [], "fp1", "cfg")
    assert front_matter(out)["configs"][0]["data_files"][0]["path"] == "train-*.parquet"
    assert sorted(p.name for p in out.glob("*train-*")) == ["train-00000.parquet", "train-00001.parquet"]
    store.release_lease()


def test_a_users_readme_is_left_alone(tiny_models, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:2]])
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("# my notes\n")
    assert main(build_args(tiny_models, prompts, out)) == 0
    assert (out / "README.md").read_text() == "# my notes\n"
    assert json.loads((out / "_manifest.json").read_text())["dataset_card"] is None
    assert "README.md: not a dataset card this pipeline wrote" in capsys.readouterr().err


def test_an_output_of_the_older_layout_is_read_but_not_resumed(tmp_path):
    store = OutputStore(str(tmp_path))
    store.commit_shard(0, [{"prompt_id": "x", "prompt": "p", "chosen": "a", "rejected": "b", "source_row": 0}], [],
                       "fp0", "cfg")
    marker_path = tmp_path / "_markers" / "part-00000.json"
    marker = json.loads(marker_path.read_text())
    (tmp_path / "train-00000.parquet").rename(tmp_path / "part-00000.parquet")
    marker_path.write_text(json.dumps({**marker, "part": "part-00000.parquet"}))
    (tmp_path / "_SUCCESS").write_text("{}")
    assert store.committed_parts() == [str(tmp_path / "part-00000.parquet")]
    with pytest.raises(OutputConflict, match="older version of this pipeline .*part-00000.parquet.*--overwrite"):
        store.committed({0: ("fp0", "cfg")})


def test_s3_output_gets_a_card_without_credentials(tiny_models, tmp_path, monkeypatch):
    import s3fs

    with moto_s3() as endpoint:
        options = {**s3_options(endpoint), "key": KEY, "secret": SECRET}
        fs = s3fs.S3FileSystem(**options)
        prompts = write_jsonl(tmp_path / "p.jsonl", MIXED_ROWS)
        fs.put(str(prompts), "bucket/in/p.jsonl")
        argv = build_args(tiny_models, "s3://bucket/in/p.jsonl", "s3://bucket/out/run",
                          "--set", f"data.storage_options={json.dumps(options)}")
        monkeypatch.setattr(sys, "argv", ["bon-build", *argv])  # the command the card records
        assert main(argv) == 0
        fs.invalidate_cache()
        card = fs.cat("bucket/out/run/README.md").decode()
        manifest = fs.cat("bucket/out/run/_manifest.json").decode()
        local = tmp_path / "copy"
        fs.get("bucket/out/run/", str(local), recursive=True)
    for text in (card, manifest):
        assert SECRET not in text and KEY not in text
    assert "data.storage_options=" in card and "[redacted]" in card
    configs = {c["config_name"]: c["data_files"][0]["path"] for c in front_matter(local)["configs"]}
    assert configs == {"default": "train-*.parquet", "rejects": "_rejects/*.parquet"}
    assert by_row(datasets.load_dataset(str(local), split="train").to_list()) == by_row(committed_rows(local))

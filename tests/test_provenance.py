"""What built each shard (issue 36): a resume refuses a change of anything that computes the samples
or the rewards (each model's weights or Hub commit, the reward function's code) or of the output's
schema, naming it; pair files appear only at their commit, so both ``load_dataset`` forms read
exactly the committed pairs after a kill at any step of the commit protocol; ``--overwrite`` leaves
no stray pair file; a build with no pairs has a card that says so."""

from __future__ import annotations

import json
import shutil

import datasets
import pyarrow.parquet as pq
import pytest
import torch

from jobs.build_dataset import main
from pipeline.data.store import OutputStore, part_name, pending_name
from pipeline.errors import OutputConflict
from tests.conftest import GOOD_PROMPTS, write_jsonl

PROMPTS = [{"prompt": p, "meta": {"level": i}} for i, p in enumerate(GOOD_PROMPTS[:6])]

LENGTH_REWARD = '''
def reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]
'''
SHORT_REWARD = '''
def reward(prompts, completions, **kwargs):
    return [-float(len(c)) for c in completions]
'''


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def build_args(models, prompts, output, *extra) -> list[str]:
    return ["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(output),
            "--set", f"models.generator={models['generator']}", "--set", f"models.reward={models['reward']}",
            "--set", f"models.draft={models['draft']}", "--set", "runtime.local=true", "--max-new-tokens", "8",
            "--num-samples", "2", "--set", "data.shard_size=3", "--set", "data.extra_columns=[meta]", "--no-progress",
            *(["--set", "strategy.decision_token=4"] if "dsbd" not in extra else []), *extra]


def perturb(model_dir) -> None:
    """Save the model again with one weight changed (retrained weights at the same path)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(model_dir)
    auto = AutoModelForSequenceClassification if config.architectures[0].endswith("Classification") else \
        AutoModelForCausalLM
    model = auto.from_pretrained(model_dir)
    with torch.no_grad():
        next(model.parameters()).add_(0.5)
    model.save_pretrained(model_dir)


@pytest.fixture
def models(tiny_models, tmp_path):
    """The tiny models copied (their weights get changed here), and a reward function module."""
    out = {role: tmp_path / "models" / role for role in ("generator", "reward", "draft")}
    for role, path in out.items():
        shutil.copytree(tiny_models[role], path)
    return out


def resume_after_kill(out) -> None:
    """A build killed after its first shard: the later shards' markers and files are gone."""
    for marker in sorted((out / "_markers").glob("*.json"))[1:]:
        marker.unlink()
    (out / "_SUCCESS").unlink()


CHANGES = {
    "models.reward": "reward function code",
    "models.generator": "generator weights",
    "models.draft": "draft weights",
    "models.reward ": "reward model weights",
    "output schema": "input's extra column gained a field",
}


@pytest.mark.parametrize("key", list(CHANGES), ids=list(CHANGES.values()))
def test_a_resume_refuses_a_change_of_what_built_the_shards(key, models, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_reward.py").write_text(LENGTH_REWARD)
    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "out"
    extra = ["--set", "models.reward=my_reward:reward"] if key == "models.reward" else []
    extra += ["--strategy", "dsbd"] if key == "models.draft" else []
    assert main(build_args(models, prompts, out, *extra)) == 0
    resume_after_kill(out)
    if key == "models.reward":
        (tmp_path / "my_reward.py").write_text(SHORT_REWARD)  # same module:function, other code
    elif key == "output schema":
        write_jsonl(prompts, [{**row, "meta": {"level": 0, "source": "new"}} if i == 5 else row
                              for i, row in enumerate(PROMPTS)])
    else:
        perturb(models[key.strip().split(".")[1]])
    capsys.readouterr()
    assert main(build_args(models, prompts, out, *extra)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note:")]
    assert len(err) == 1 and f"({key.strip()}: " in err[0] and "--overwrite" in err[0], err
    assert main(build_args(models, prompts, out, *extra, "--overwrite")) == 0


def test_an_unchanged_resume_goes_on_and_weights_are_hashed_once(models, tmp_path, monkeypatch):
    import pipeline.provenance as provenance

    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS)
    out = tmp_path / "out"
    assert main(build_args(models, prompts, out)) == 0
    resume_after_kill(out)
    provenance._weights_cache.clear()  # a new process: only the cache on disk is left
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: (opened.append(str(f)), real_open(f, *a, **k))[1])
    assert main(build_args(models, prompts, out)) == 0
    monkeypatch.undo()
    assert not [f for f in opened if f.endswith(".safetensors")]  # no weight file was reread for its hash
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["shards_skipped"] == [0] and set(manifest["identity"]) == {
        "models.generator", "models.reward", "output schema"}


def test_hub_commit_is_asked_of_the_hub_first(monkeypatch):
    from huggingface_hub import HfApi

    from pipeline.provenance import model_identity, model_provenance

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(HfApi, "model_info", lambda self, repo, revision=None, timeout=None:
                        type("Info", (), {"sha": "b" * 40})())
    assert model_identity(model_provenance("org/model", "main")) == "commit " + "b" * 40
    monkeypatch.setattr(HfApi, "model_info", lambda self, repo, revision=None, timeout=None:
                        type("Info", (), {"sha": "c" * 40})())  # main moved on
    assert model_identity(model_provenance("org/model", "main")) == "commit " + "c" * 40
    assert model_provenance("org/model", "d" * 40)["commit"] == "d" * 40  # a pinned commit is its own identity


def test_a_hub_commit_change_is_refused_by_the_store(tmp_path):
    store = OutputStore(str(tmp_path))
    built = {"models.generator": "commit " + "b" * 40, "output schema": "{}"}
    store.commit_shard(0, [], [], "fp0", "cfg", identity=built)
    assert store.committed({0: ("fp0", "cfg")}, built) == {0}
    with pytest.raises(OutputConflict, match=r"models.generator: commit bbbbbbbbbbbb.. -> commit cccccccccccc.."):
        store.committed({0: ("fp0", "cfg")}, {**built, "models.generator": "commit " + "c" * 40})
    older = OutputStore(str(tmp_path / "older"))
    older.commit_shard(0, [], [], "fp0", "cfg")  # as a build before identities wrote it
    with pytest.raises(OutputConflict, match="no build identity recorded"):
        older.committed({0: ("fp0", "cfg")}, built)


def test_verify_refuses_a_pair_file_of_another_schema(tmp_path):
    import pyarrow as pa

    from pipeline.data.schema import PAIR_SCHEMA, ExtraColumns

    narrow, wide = ExtraColumns(), ExtraColumns()
    narrow.add([{"meta": {"level": 1}}])
    wide.add([{"meta": {"level": 1, "source": "x"}}])
    store = OutputStore(str(tmp_path))
    row = {"prompt_id": "x", "prompt": "p", "chosen": "a", "rejected": "b", "meta": {"level": 1}}
    store.commit_shard(0, [row], [], "fp0", "cfg", extra=narrow)
    store.commit_shard(1, [row], [], "fp1", "cfg", extra=wide)
    assert [k for k, _ in store.verify(1, schema=narrow.schema(PAIR_SCHEMA))] == [0]
    with pytest.raises(OutputConflict, match="train-00001.parquet has another schema .*meta"):
        list(store.verify(2, schema=narrow.schema(PAIR_SCHEMA)))
    assert isinstance(wide.schema(PAIR_SCHEMA).field("meta").type, pa.StructType)


STEPS = ("side files", "pending pair file", "marker", "rename")


@pytest.mark.parametrize("step", range(len(STEPS)), ids=STEPS)
def test_both_load_dataset_forms_read_the_committed_pairs_after_a_kill_at_any_step(step, tmp_path, monkeypatch):
    """Shard 0 committed; shard 1's commit killed just before step ``step`` (the steps of
    OutputStore.commit_shard, in order). Both readers read shard 0 exactly, whatever the step; a
    rerun's store (the committed check and prepare) completes or redoes shard 1."""
    store = OutputStore(str(tmp_path))
    rows = [[{"prompt_id": f"{k}-{i}", "prompt": "p", "chosen": "a", "rejected": "b", "source_row": 3 * k + i}
             for i in range(3)] for k in range(2)]
    store.acquire_lease("cfg")
    store.prepare()
    store.commit_shard(0, rows[0], [], "fp0", "cfg")
    calls = []

    class Killed(BaseException):
        pass

    def count(real):
        def wrapper(*args, **kwargs):
            calls.append(1)
            if len(calls) > {0: 0, 1: 2, 2: 3, 3: 4}[step]:
                raise Killed
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(store, "_write_bytes", count(store._write_bytes))
    monkeypatch.setattr(store, "_rename", count(store._rename))
    with pytest.raises(Killed):
        store.commit_shard(1, rows[1], [], "fp1", "cfg")
    monkeypatch.undo()
    store.release_lease()
    expected = sorted(r["prompt_id"] for r in rows[0])
    for loaded in (datasets.load_dataset(str(tmp_path), split="train"),
                   datasets.load_dataset("parquet", data_dir=str(tmp_path), split="train")):
        assert sorted(loaded["prompt_id"]) == expected, STEPS[step]
    read = OutputStore(str(tmp_path)).read_committed(allow_partial=True)
    assert [p.rsplit("/", 1)[1] for p in read.parts] == [part_name(0)]
    rerun = OutputStore(str(tmp_path))
    rerun.acquire_lease("cfg")
    done = rerun.committed({0: ("fp0", "cfg"), 1: ("fp1", "cfg")})
    rerun.prepare()
    rerun.release_lease()
    assert done == ({0, 1} if step == 3 else {0})  # killed before the rename: the marker is there, completed
    assert not (tmp_path / pending_name(1)).exists()
    assert (tmp_path / part_name(1)).exists() == (step == 3)


def test_overwrite_with_fewer_shards_leaves_no_stray_pair_file(models, tmp_path):
    many = write_jsonl(tmp_path / "many.jsonl", PROMPTS)
    few = write_jsonl(tmp_path / "few.jsonl", PROMPTS[:3])
    out = tmp_path / "out"
    assert main(build_args(models, many, out)) == 0
    (out / "_markers" / "part-00001.json").unlink()  # a killed build of an older version: no marker
    assert main(build_args(models, few, out, "--overwrite")) == 0
    assert sorted(p.name for p in out.glob("*.parquet")) == [part_name(0)]
    by_card = datasets.load_dataset(str(out), split="train")
    by_name = datasets.load_dataset("parquet", data_dir=str(out), split="train")
    assert len(by_card) == len(by_name) == pq.read_metadata(out / part_name(0)).num_rows


def test_a_build_with_no_pairs_has_a_card_that_says_so(models, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "   ", "meta": 1}, {"prompt": "", "meta": 2}])
    out = tmp_path / "out"
    assert main(build_args(models, prompts, out)) == 0
    assert json.loads((out / "_manifest.json").read_text())["pairs"] == 0
    with pytest.raises(FileNotFoundError, match="NO PAIRS - this build made none"):
        datasets.load_dataset(str(out), split="train")
    assert "This build made no pairs" in (out / "README.md").read_text()
    rejects = datasets.load_dataset("parquet", data_files=f"{out}/_rejects/*.parquet", split="train")
    assert sorted(rejects["reason"]) == ["blank prompt", "blank prompt"]


def test_candidate_scores_off_hashes_as_builds_from_before_the_key():
    """data.candidate_scores changes the output's columns, so it is in the config hash when on; off,
    a build made before the key existed resumes (its hash is the same)."""
    import hashlib

    from pipeline.config import load_config
    from pipeline.provenance import config_hash

    config = load_config("configs/demo.yaml")
    content = config.to_dict()
    content.pop("runtime")
    for key in ("device", "vllm", "reward_vllm"):
        content["models"].pop(key)
    content["models"].pop("reward_weights", None) if content["models"].get("reward_weights") is None else None
    for key in ("prompts", "output", "storage_options", "split", "subset", "revision", "candidate_scores"):
        content["data"].pop(key)
    before = hashlib.sha256(json.dumps(content, sort_keys=True, default=repr).encode()).hexdigest()
    assert config_hash(config) == before
    assert config_hash(load_config("configs/demo.yaml", ["data.candidate_scores=true"])) != before

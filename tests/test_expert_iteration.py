"""Expert iteration end to end on the tiny models (in-process builds), its resume, the evaluate
job, and the scheduling example in infra/."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
import yaml

from jobs.evaluate import main as evaluate_main
from jobs.expert_iteration import main
from pipeline.engines.reward_transformer import has_trained_channel
from tests.conftest import GOOD_PROMPTS, write_jsonl


def args(tiny_models, prompts, output, *extra, rounds=2, dpo=True):
    return ["--config", "configs/demo.yaml", "--rounds", str(rounds), "--output", str(output), "--prompts", str(prompts),
            *(["--dpo", "--dpo-steps", "1", "--dpo-learning-rate", "1e-4"] if dpo else []),
            "--strategy-after", "sla", "--epochs", "1",
            "--batch-size", "2", "--hidden-size", "8", "--learning-rate", "1e-3", "--no-progress",
            "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
            "--set", "runtime.local=true", "--set", "sampling.num_samples=3", "--set", "sampling.max_new_tokens=8",
            "--set", "strategy.decision_token=4", "--set", "strategy.step_size=4", *extra]


def instruction_prompts(tmp_path: Path) -> Path:
    """Four prompts with IFEval's columns (the evaluate job judges by them): the first asks for at
    least 500 words, which no response of a few tokens follows."""
    rows = [("Write a review of the lamp.", "length_constraints:number_words",
             {"num_words": 500, "relation": "at least"}),
            ("Explain why the battery lasts so long.", "length_constraints:number_words",
             {"num_words": 500, "relation": "less than"}),
            ("Describe how the blender works.", "punctuation:no_comma", {}),
            ("Tell me if the camera is good.", "change_case:english_lowercase", {})]
    return write_jsonl(tmp_path / "ifeval.jsonl", [{"prompt": p, "instruction_id_list": [i], "kwargs": [k]}
                                                   for p, i, k in rows])


def schedule(out: Path) -> tuple[Path, dict]:
    """The current schedule's directory and record."""
    progress = json.loads((out / "progress.json").read_text())
    return out / f"schedule-{progress['current']}", progress["schedules"][progress["current"]]


def files(directory: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in directory.rglob("*") if p.is_file() and p.name != "progress.json"}


def weight_digests(model: Path) -> dict:
    """Each tensor of a model directory's safetensors files, by name, as the sha256 of its bytes."""
    import hashlib

    from safetensors.torch import load_file

    return {name: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for f in sorted(model.glob("*.safetensors")) for name, t in load_file(f).items()}


def test_two_rounds_then_resume(tiny_models, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:4]])
    out = tmp_path / "ei"
    assert main(args(tiny_models, prompts, out)) == 0
    sdir, record = schedule(out)
    progress = record["rounds"]
    assert progress["0"]["generator"] == str(tiny_models["generator"]) and progress["0"]["strategy"] == "sbon"
    # Round 1 builds with round 0's model, by SLA on its trained channel.
    assert progress["1"]["generator"] == str(sdir / "round-00" / "model") and progress["1"]["strategy"] == "sla"
    assert all(len(progress[r][k]) == 64 for r in "01" for k in ("config_sha256", "input_sha256"))
    for r in ("round-00", "round-01"):
        manifest = json.loads((sdir / r / "pairs" / "_manifest.json").read_text())
        assert manifest["prompts_in"] == 4 and manifest["pairs"] >= 2
        assert has_trained_channel(str(sdir / r / "model"))
    assert record["final_model"] == str(sdir / "round-01" / "model")
    assert capsys.readouterr().out.strip().endswith(f"final model: {sdir / 'round-01' / 'model'}")

    # The same config and input again: nothing runs, nothing on disk changes.
    before = files(out)
    assert main(args(tiny_models, prompts, out)) == 0
    err = capsys.readouterr().err
    assert "round 0: up to date, skipped" in err and "round 1: up to date, skipped" in err
    assert files(out) == before

    # Interrupted after round 1's build: the rerun trains round 1 only, to the same model.
    weights = weight_digests(sdir / "round-01" / "model")
    assert weights  # the policy's tensors at least
    (sdir / "round-01" / "model" / "training_metrics.json").unlink()
    assert main(args(tiny_models, prompts, out)) == 0
    err = capsys.readouterr().err
    assert "round 0: up to date, skipped" in err and "round 1: build up to date, skipped" in err
    assert (sdir / "round-01" / "model" / "training_metrics.json").exists()
    assert weight_digests(sdir / "round-01" / "model") == weights
    assert {p: t for p, t in before.items() if "round-00" in str(p)} == {p: t for p, t in files(out).items()
                                                                         if "round-00" in str(p)}

    # The evaluate job on round 1's model: every method against greedy, each response judged by IFEval
    # against its prompt's instructions (one each). Eight new tokens never make 500 words, so no method
    # follows the first prompt: an accuracy above 3/4 would mean its instruction went unchecked.
    report = tmp_path / "eval.json"
    assert evaluate_main(["--generator", str(sdir / "round-01" / "model"), "--reward", str(tiny_models["reward"]),
                          "--prompts", str(instruction_prompts(tmp_path)), "--max-new-tokens", "8",
                          "--num-samples", "2", "--step-size", "4", "--report", str(report)]) == 0
    figures = json.loads(report.read_text())
    assert figures["judge"] == "ifeval-strict" and figures["prompts"] == 4
    methods = figures["methods"]
    assert list(methods) == ["greedy", "temperature", "top_p", "top_k", "beam", "sla", "sbon"]
    assert methods["greedy"]["win_rate"] == 0.5 and methods["greedy"]["tie"] == 1.0
    assert all(0 <= m["win_rate"] <= 1 and abs(m["win"] + m["tie"] + m["loss"] - 1) < 1e-9 for m in methods.values())
    assert all(m["prompt_level_strict"] <= 3 / 4 and m["instruction_level_strict"] <= 3 / 4 for m in methods.values())
    assert methods["sla"]["token_cost_vs_greedy"] > 1

    judge_the_rounds(tiny_models, out, tmp_path, capsys)


def judge_the_rounds(tiny_models, out: Path, tmp_path: Path, capsys):
    """benchmarks.ei_rounds on the schedule: the start and both rounds' policies judged on the same
    held-out prompts with the same seeds, every figure recomputable from the kept data alone."""
    from benchmarks.ei_rounds import main as ei_rounds
    from pipeline.judge import accuracy

    root = Path(__file__).resolve().parents[1] / "configs"
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join((root / "prompts" / "ifeval-eval.jsonl").read_text().splitlines(True)[:3]))
    data = tmp_path / "ei-data"
    common = ["--config", str(root / "real.yaml"), "--set", "sampling.chat_template=never", "--eval-prompts",
              str(held_out), "--data", str(data), "--resamples", "200"]
    argv = [*common, "--schedule", str(out), "--reward", str(tiny_models["reward"]), "--eval-samples", "2",
            "--eval-max-new-tokens", "8"]
    assert ei_rounds([*argv, "--json", str(tmp_path / "rounds.json"), "--plot", str(tmp_path / "rounds.png")]) == 0
    figures = json.loads((tmp_path / "rounds.json").read_text())
    assert [r["policy"] for r in figures["policies"]] == ["start", "round 1", "round 2"]
    assert (tmp_path / "rounds.png").stat().st_size > 0
    sdir, _ = schedule(out)
    for name, row in zip(("start", "round-1", "round-2"), figures["policies"]):
        kept = json.loads(gzip.decompress((data / f"policy-{name}.json.gz").read_bytes()))
        assert [len(v) for v in kept["verdicts"]] == [2, 2, 2] and [len(s) for s in kept["reward_scores"]] == [2, 2, 2]
        judged = accuracy([v for per_prompt in kept["verdicts"] for v in per_prompt])
        for key in ("prompt_level_strict", "instruction_level_strict"):
            assert row[key]["value"] == pytest.approx(judged[key])
            assert row[key]["low"] <= row[key]["value"] <= row[key]["high"]
        scores = [x for s in kept["reward_scores"] for x in s]
        assert row["mean_reward"]["value"] == pytest.approx(sum(scores) / len(scores))
        assert row["mean_tokens"]["value"] == pytest.approx(sum(map(sum, kept["tokens"])) / 6)
    assert json.loads(gzip.decompress((data / "policy-round-2.json.gz").read_bytes()))["model"] == str(
        sdir / "round-01" / "model")
    rounds = json.loads((data / "schedule.json").read_text())["rounds"]
    for r in "01":
        pairs = json.loads((sdir / f"round-0{r}" / "pairs" / "_manifest.json").read_text())["pairs"]
        assert rounds[r]["pairs"]["pairs"] == pairs == rounds[r]["build"]["pairs"]
        assert rounds[r]["pairs"]["mean_chosen_reward"] > rounds[r]["pairs"]["mean_rejected_reward"]
    for previous, row in zip(figures["policies"], figures["policies"][1:]):
        assert row["over_optimization"] == (row["mean_reward"]["value"] > previous["mean_reward"]["value"]
                                            and row["prompt_level_strict"]["value"]
                                            < previous["prompt_level_strict"]["value"])
    gain = figures["policies"][2]["gain_over_start"]["prompt_level_strict"]
    assert gain["gain"] == pytest.approx(figures["policies"][2]["prompt_level_strict"]["value"]
                                         - figures["policies"][0]["prompt_level_strict"]["value"])
    capsys.readouterr()

    # A rerun reuses every policy's responses; --replay gives the same figures with no model at all.
    assert ei_rounds([*argv, "--json", str(tmp_path / "again.json")]) == 0
    assert capsys.readouterr().out.count("reused") == 3
    # --policies: only the named policies (the start always), the same figures for those.
    assert ei_rounds([*argv, "--policies", "round-2", "--json", str(tmp_path / "some.json")]) == 0
    some = json.loads((tmp_path / "some.json").read_text())
    assert [r["policy"] for r in some["policies"]] == ["start", "round 2"]
    assert some["policies"][1]["gain_over_start"] == figures["policies"][2]["gain_over_start"]
    assert capsys.readouterr().out.count("reused") == 2
    for bad in (["--policies", "round-3"], ["--policies", "round-1", "--replay"]):
        with pytest.raises(SystemExit) as stop:
            ei_rounds([*(common if "--replay" in bad else argv), *bad])
        assert stop.value.code == 2
        assert capsys.readouterr().err.startswith("error: --policies:")
    assert ei_rounds([*argv, "--json", str(tmp_path / "again.json")]) == 0  # schedule.json lists every policy again
    capsys.readouterr()
    assert ei_rounds([*common, "--replay", "--json", str(tmp_path / "replay.json")]) == 0
    replayed = json.loads((tmp_path / "replay.json").read_text())
    assert {k: v for k, v in replayed.items() if k != "environment"} == {
        k: v for k, v in figures.items() if k != "environment"}
    with pytest.raises(SystemExit) as stop:
        ei_rounds([*common, "--replay", "--data", str(tmp_path / "none")])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("error: --replay:")


def test_a_changed_input_or_config_is_new_work_never_skipped(tiny_models, tmp_path, capsys):
    """The old job printed "skipped" and exited 0 here: it tested only that round 0's files existed."""
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:2]])
    out = tmp_path / "ei"
    assert main(args(tiny_models, prompts, out, rounds=1, dpo=False)) == 0
    capsys.readouterr()

    # A weekly schedule: same path, new prompts.
    write_jsonl(prompts, [{"prompt": p} for p in GOOD_PROMPTS[2:5]])
    assert main(args(tiny_models, prompts, out, rounds=1, dpo=False)) == 0
    err = capsys.readouterr().err
    assert "skipped" not in err and "(prompts changed since schedule" in err
    second, record = schedule(out)
    first = next(out / f"schedule-{sid}" for sid in json.loads((out / "progress.json").read_text())["schedules"]
                 if out / f"schedule-{sid}" != second)
    manifest = json.loads((second / "round-00" / "pairs" / "_manifest.json").read_text())
    assert manifest["prompts_in"] == 3 and record["rounds"]["0"]["build"]["prompts_in"] == 3
    assert (first / "round-00" / "pairs" / "_SUCCESS").exists()  # the earlier schedule is kept

    # Another N: another build config.
    assert main(args(tiny_models, prompts, out, "--set", "sampling.num_samples=2", rounds=1, dpo=False)) == 0
    err = capsys.readouterr().err
    third, _ = schedule(out)
    assert "skipped" not in err and third not in (first, second) and "(build config" in err
    manifest = json.loads((third / "round-00" / "pairs" / "_manifest.json").read_text())
    assert manifest["config"]["sampling"]["num_samples"] == 2
    assert main(args(tiny_models, prompts, out, "--set", "sampling.num_samples=2", rounds=1, dpo=False)) == 0
    assert "round 0: up to date, skipped" in capsys.readouterr().err

    # A reward model that does not exist: one line, exit 2, before anything runs.
    before = files(out), (out / "progress.json").read_text()
    assert main(args(tiny_models, prompts, out, "--set", f"models.reward={tmp_path / 'nope'}", rounds=1,
                     dpo=False)) == 2
    err = capsys.readouterr().err
    assert err == f"error: models.reward: {str(tmp_path / 'nope')!r}: no such model directory\n"
    assert (files(out), (out / "progress.json").read_text()) == before


def test_user_errors_are_one_line(tiny_models, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": GOOD_PROMPTS[0]}])
    cases = [(["--strategy-after", "nosuch"], "error: strategy.name: unknown strategy 'nosuch'"),
             (["--set", f"models.draft={tmp_path / 'nope'}", "--strategy-after", "dsbd"], "error: models.draft: cannot load"),
             (["--prompts", str(tmp_path / "none.jsonl")], "error: data.prompts:"),
             (["--objective", "tcrm", "--mc-weight", "-0.5"], "error: --mc-weight must be >= 0, got -0.5")]
    for extra, message in cases:
        assert main(args(tiny_models, prompts, tmp_path / "ei", *extra)) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note:")]
        assert len(err) == 1 and err[0].startswith(message), err
    (tmp_path / "ei").mkdir(exist_ok=True)
    (tmp_path / "ei" / "progress.json").write_text("{broken")
    assert main(args(tiny_models, prompts, tmp_path / "ei")) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'ei' / 'progress.json'}: unreadable")


def test_evaluate_refuses_sla_without_channel(tiny_models, tmp_path, capsys):
    prompts = instruction_prompts(tmp_path)
    assert evaluate_main(["--generator", str(tiny_models["generator"]), "--reward", str(tiny_models["reward"]),
                          "--prompts", str(prompts), "--methods", "greedy,sla"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --generator: strategy 'sla' needs") and "trained reward channel" in err
    assert err.count("\n") == 1
    # Not named: skipped with a note, the other default methods compared.
    report = tmp_path / "eval.json"
    assert evaluate_main(["--generator", str(tiny_models["generator"]), "--reward", str(tiny_models["reward"]),
                          "--prompts", str(prompts), "--max-new-tokens", "4", "--num-samples", "2",
                          "--report", str(report)]) == 0
    assert list(json.loads(report.read_text())["methods"]) == ["greedy", "temperature", "top_p", "top_k", "beam", "sbon"]
    assert "note: sla skipped (--generator: strategy 'sla' needs" in capsys.readouterr().err
    assert evaluate_main(["--generator", str(tmp_path / "nope"), "--reward", str(tiny_models["reward"]),
                          "--prompts", str(prompts), "--methods", "greedy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --generator: cannot load") and err.count("\n") == 1


def test_cronjob_example_runs_expert_iteration():
    """The CronJob runs the job in the image's working directory, on what the image holds and the
    volume provides; its arguments parse and resolve to a config whose models and prompts are all
    on the volume (a model path under .cache/ or /app, as before, exists in no image)."""
    from jobs.expert_iteration import parse_args, round_config
    from pipeline.config import load_config

    docs = list(yaml.safe_load_all(Path("infra/expert_iteration_cronjob.yaml").read_text()))
    doc = next(d for d in docs if d["kind"] == "CronJob")
    assert doc["apiVersion"] == "batch/v1"
    assert len(doc["spec"]["schedule"].split()) == 5
    pod = doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["bon-expert-iteration"]
    dockerfile = Path("infra/Dockerfile").read_text().splitlines()
    workdir = [line.split()[1] for line in dockerfile if line.startswith("WORKDIR")][-1]
    copied = {p.strip("./") for line in dockerfile if line.startswith("COPY")
              for p in line.split()[1:-1] if not p.startswith("--")}
    assert container["workingDir"] == workdir
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    args = parse_args(container["args"])
    assert args.rounds >= 1 and Path(args.config).exists() and Path(args.config).parts[0] in copied
    generator = load_config(args.config, [o for o in args.overrides if not o.startswith("strategy.")]).models.generator
    config = round_config(args, 0, generator, Path(args.output))
    for path in (args.output, args.prompts, config.models.generator, config.models.reward):
        assert any(path.startswith(m + "/") for m in mounts), path
    assert not config.models.draft


E1_TRAINING = ["--dpo", "--dpo-steps", "4", "--dpo-learning-rate", "3e-5", "--batch-size", "8", "--epochs", "1"]
"""The training flags of the committed rounds (docs/benchmarks.md, E1)."""


def stubbed_rounds(monkeypatch, tmp_path: Path, out: Path, *extra) -> list[int]:
    """The job with its models' check, builds and training stubbed (a schedule's bookkeeping only);
    the seed each round's training got."""
    import jobs.expert_iteration as ei
    import pipeline.training.dpo
    import pipeline.training.reward_channel

    seeds = []

    def fake_train(pairs, generator, output, **kwargs):
        seeds.append(kwargs["seed"])
        Path(output).mkdir(parents=True, exist_ok=True)
        return {"train_loss": 0.5, "pairwise_accuracy": 0.5, "autrc": 0.5, "steps": 1}

    monkeypatch.setattr(ei, "check_models", lambda config, generator=True: None)
    monkeypatch.setattr(ei, "build", lambda config, progress, overwrite: {
        "pairs": 1, "prompts_in": 1, "generated_tokens": 10, "wall_seconds": 0.1})
    monkeypatch.setattr(pipeline.training.dpo, "load_pairs", lambda uri, token_ids=False: [])
    monkeypatch.setattr(pipeline.training.reward_channel, "train_reward_transformer", fake_train)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": GOOD_PROMPTS[0]}])
    assert main(["--config", "configs/real.yaml", "--rounds", "2", "--output", str(out), "--prompts", str(prompts),
                 "--no-progress", *E1_TRAINING, *extra]) == 0
    return seeds


def test_a_training_seed_reseeds_every_round_and_keys_a_schedule_of_its_own(monkeypatch, tmp_path):
    """Round r trains with seed r + 1000 * S. S = 0 leaves the key as it was before the flag (the
    committed schedule c0bc9edb6a5d keeps its id); S = 1 is another schedule."""
    committed = json.loads(Path("benchmarks/results/ei-rounds/schedule.json").read_text())
    from jobs.expert_iteration import key_id

    assert key_id(committed["key"]) == committed["schedule"] == "c0bc9edb6a5d"
    assert stubbed_rounds(monkeypatch, tmp_path, tmp_path / "s0") == [0, 1]
    _, plain = schedule(tmp_path / "s0")
    assert plain["key"]["training"] == committed["key"]["training"]
    assert stubbed_rounds(monkeypatch, tmp_path, tmp_path / "s1", "--training-seed", "1") == [1000, 1001]
    _, seeded = schedule(tmp_path / "s1")
    assert seeded["key"]["training"] == {**committed["key"]["training"], "training_seed": 1}
    assert {k: v for k, v in seeded["key"].items() if k != "training"} == {
        k: v for k, v in plain["key"].items() if k != "training"}
    assert key_id(seeded["key"]) != key_id(plain["key"])


def test_set_strategy_name_switches_every_round_of_an_sbon_config(capsys):
    """The control arm's overrides on configs/real.yaml (an sbon config): every round builds with
    best_of_n and N = 16; sbon's decision_token and rejection_rate are dropped, not an error."""
    from jobs.expert_iteration import parse_args, round_config

    base = ["--config", "configs/real.yaml", "--rounds", "3", "--output", "out/x", *E1_TRAINING]
    control = parse_args([*base, "--set", "strategy.name=best_of_n", "--set", "sampling.num_samples=16",
                          "--set", "strategy.rejection_rate=0.5"])
    for r in (0, 1, 2):
        config = round_config(control, r, "g", Path("out/x/pairs"))
        assert (config.strategy.name, config.sampling.num_samples) == ("best_of_n", 16)
    sbon = round_config(parse_args(base), 1, "g", Path("out/x/pairs"))
    assert (sbon.strategy.name, sbon.strategy.params.rejection_rate, sbon.sampling.num_samples) == ("sbon", 0.75, 32)
    # --strategy-after still wins from round 1 on.
    later = parse_args([*base, "--set", "strategy.name=best_of_n", "--strategy-after", "sbon"])
    assert [round_config(later, r, "g", Path("out/x/pairs")).strategy.name for r in (0, 1)] == ["best_of_n", "sbon"]

"""Expert iteration end to end on the tiny models (in-process builds), its resume, the evaluate
job, and the scheduling example in infra/."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from jobs.evaluate import main as evaluate_main
from jobs.expert_iteration import main
from pipeline.engines.reward_transformer import has_trained_channel
from tests.conftest import GOOD_PROMPTS, write_jsonl


def args(tiny_models, prompts, output):
    return ["--config", "configs/demo.yaml", "--rounds", "2", "--output", str(output), "--prompts", str(prompts),
            "--dpo", "--dpo-steps", "1", "--dpo-learning-rate", "1e-4", "--strategy-after", "sla", "--epochs", "1",
            "--batch-size", "2", "--hidden-size", "8", "--learning-rate", "1e-3", "--no-progress",
            "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
            "--set", "runtime.local=true", "--set", "sampling.num_samples=3", "--set", "sampling.max_new_tokens=8",
            "--set", "strategy.decision_token=4", "--set", "strategy.step_size=4"]


def test_two_rounds_then_resume(tiny_models, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:4]])
    out = tmp_path / "ei"
    assert main(args(tiny_models, prompts, out)) == 0
    progress = json.loads((out / "progress.json").read_text())["rounds"]
    assert progress["0"]["generator"] == str(tiny_models["generator"]) and progress["0"]["strategy"] == "sbon"
    # Round 1 builds with round 0's model, by SLA on its trained channel.
    assert progress["1"]["generator"] == str(out / "round-00" / "model") and progress["1"]["strategy"] == "sla"
    for r in ("round-00", "round-01"):
        manifest = json.loads((out / r / "pairs" / "_manifest.json").read_text())
        assert manifest["prompts_in"] == 4 and manifest["pairs"] >= 2
        assert has_trained_channel(str(out / r / "model"))
    assert capsys.readouterr().out.strip().endswith(f"final model: {out / 'round-01' / 'model'}")

    # Interrupted after round 1's build: the rerun trains round 1 only.
    before = {p: p.stat().st_mtime_ns for p in (out / "round-00").rglob("*") if p.is_file()}
    (out / "round-01" / "model" / "training_metrics.json").unlink()
    assert main(args(tiny_models, prompts, out)) == 0
    err = capsys.readouterr().err
    assert "round 0: build finished earlier" in err and "round 1: build finished earlier" in err
    assert "round 1: training finished earlier" not in err
    assert (out / "round-01" / "model" / "training_metrics.json").exists()
    assert before == {p: p.stat().st_mtime_ns for p in (out / "round-00").rglob("*") if p.is_file()}

    # The evaluate job on round 1's model: every method against greedy, judged by the labeler.
    report = tmp_path / "eval.json"
    assert evaluate_main(["--model", str(out / "round-01" / "model"), "--judge", str(tiny_models["reward"]),
                          "--prompts", str(prompts), "--max-new-tokens", "8", "--num-samples", "2", "--step-size", "4",
                          "--output", str(report)]) == 0
    methods = json.loads(report.read_text())["methods"]
    assert list(methods) == ["greedy", "temperature", "top_p", "top_k", "beam", "sla", "sbon"]
    assert methods["greedy"]["win_rate"] == 0.5 and methods["greedy"]["tie"] == 1.0
    assert all(0 <= m["win_rate"] <= 1 and abs(m["win"] + m["tie"] + m["loss"] - 1) < 1e-9 for m in methods.values())
    assert methods["sla"]["token_cost_vs_greedy"] > 1


def test_evaluate_refuses_sla_without_channel(tiny_models, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": GOOD_PROMPTS[0]}])
    assert evaluate_main(["--model", str(tiny_models["generator"]), "--judge", str(tiny_models["reward"]),
                          "--prompts", str(prompts), "--methods", "greedy,sla"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model:") and "trained reward channel" in err
    assert evaluate_main(["--model", str(tmp_path / "nope"), "--judge", str(tiny_models["reward"]),
                          "--prompts", str(prompts), "--methods", "greedy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model: cannot load") and err.count("\n") == 1


def test_cronjob_example_runs_expert_iteration():
    doc = yaml.safe_load(Path("infra/expert_iteration_cronjob.yaml").read_text())
    assert doc["kind"] == "CronJob" and doc["apiVersion"] == "batch/v1"
    assert len(doc["spec"]["schedule"].split()) == 5
    container = doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "jobs.expert_iteration"]
    assert any(a.startswith("--rounds=") for a in container["args"])

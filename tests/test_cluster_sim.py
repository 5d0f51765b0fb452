"""benchmarks.cluster_sim: the real build and coordinator over simulated actors account for every
row, and its utilization and driver figures are measured, not assumed (a small case; the 64-actor
run is the benchmark's, quoted in the README)."""

import json

import pytest

from benchmarks.cluster_sim import main


@pytest.mark.parametrize("strategy", ["sbon", "best_of_n"])
def test_simulated_cluster_loses_and_duplicates_nothing(strategy, tiny_models, tmp_path):
    out = tmp_path / "sim.json"
    rc = main(["--generators", "4", "--rewards", "2", "--num-prompts", "90", "--shard-size", "20", "--strategy", strategy,
               "--num-samples", "8", "--max-new-tokens", "64", "--decision-token", "8", "--time-scale", "0.002",
               "--tokenizer", str(tiny_models["generator"]), "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())["results"][0]
    assert (result["lost"], result["duplicated"], result["pairs"]) == (0, 0, 90)
    assert 0 < result["generator_utilization"] <= 1 and 0 < result["reward_utilization"] <= 1
    assert result["driver_cpu_seconds"] > 0
    # sbon stops most rows at the decision token: it must generate far fewer tokens than Best-of-N's
    # 90 prompts x 8 rows, each running to its own EOS or 64 tokens.
    assert result["generated_tokens"] <= 90 * 8 * 64
    if strategy == "sbon":
        assert result["generated_tokens"] < 0.6 * 90 * 8 * 64


def test_sweep_reports_one_result_per_generator_count(tiny_models, tmp_path):
    out = tmp_path / "sweep.json"
    assert main(["--sweep", "1,2", "--generators", "2", "--rewards", "2", "--num-prompts", "24", "--shard-size", "8",
                 "--num-samples", "4", "--max-new-tokens", "16", "--decision-token", "4", "--time-scale", "0.002",
                 "--tokenizer", str(tiny_models["generator"]), "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["generators"], r["rewards"]) for r in results] == [(1, 1), (2, 2)]
    assert all(r["lost"] == 0 and r["duplicated"] == 0 for r in results)


def test_missing_tokenizer_is_a_one_line_error(tmp_path, capsys):
    assert main(["--tokenizer", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "nothing" in err and "\n" not in err

"""benchmarks.gpu_engine at the tiny shape on CPU (issue 38): the three runs, each in its own process,
with ray, datasets, trl and vllm unimportable as on the GPU machines it is meant for."""

from __future__ import annotations

import json

import torch

from benchmarks.gpu_engine import HEAVY_MODULES, VARIANTS, main

ABSENT = "raise ModuleNotFoundError(\"No module named '{0}' (test: absent as on the GPU machines)\", name='{0}')\n"


def test_tiny_shape_on_cpu_writes_every_run_without_ray_or_datasets(tiny_models, tmp_path, monkeypatch, capsys):
    stubs = tmp_path / "absent"
    for name in HEAVY_MODULES:  # first on the children's path: `import ray` fails there as where it is not installed
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(ABSENT.format(name))
    monkeypatch.setenv("PYTHONPATH", str(stubs))
    out = tmp_path / "out.json"
    threads = torch.get_num_threads()
    try:
        assert main(["--shape", "tiny", "--device", "cpu", "--tokenizer", str(tiny_models["generator"]),
                     "--num-prompts", "3", "--num-samples", "4", "--max-new-tokens", "8", "--prompts-per-call", "2",
                     "--reward-batch-size", "4", "--threads", "1", "--output", str(tmp_path / "builds"),
                     "--json", str(out), "--no-progress"]) == 0
    finally:  # benchmarks.parse set this process's threads to --threads: the tests after it run as before
        torch.set_num_threads(threads)

    figures = json.loads(out.read_text())
    for name in VARIANTS:
        run = figures[name]
        for key in ("seconds", "wall_seconds", "process_seconds", "tokens_per_second", "ms_per_step",
                    "peak_rss_bytes"):
            assert run[key] > 0, (name, key)
        assert run["peak_memory_bytes"] is None  # CPU: no device memory
        assert run["heavy_imports"] == []
        assert run["wall_seconds"] >= run["seconds"]
    # Every candidate of 3 prompts x N=4 decoded (EOS may end one early); sbon's pruned ones stop at tau.
    assert 3 * 4 * 2 <= figures["plain"]["generated_tokens"] <= 3 * 4 * 8
    assert 3 * 4 * 2 <= figures["best_of_n"]["generated_tokens"] <= 3 * 4 * 8
    assert figures["sbon"]["generated_tokens"] <= figures["best_of_n"]["generated_tokens"]
    assert figures["plain"]["responses"] == 12 and figures["plain"]["decode_steps"] <= 2 * 8
    assert figures["best_of_n"]["pairs"] == figures["sbon"]["pairs"] == 3
    floor = figures["floor"]
    assert floor["estimate"] is True and floor["rows"] == 12 and floor["step_ms"] > 0
    assert floor["weights_bytes"] == figures["parameters"]["generator"] * 4  # float32
    assert set(figures["ratios_to_plain"]) == set(VARIANTS) and figures["ratios_to_plain"]["plain"]["speed"] == 1.0
    assert {"date", "packages", "machine", "command"} <= set(figures["environment"])
    printed = capsys.readouterr().out
    assert "floor (ESTIMATE" in printed and "vs plain" in printed

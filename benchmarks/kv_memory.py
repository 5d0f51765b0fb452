"""Peak memory of in-process speculative rejection on the real models as prompts grow:
16 short prompts; the same 16 plus one prompt of about 1,700 tokens; eight prompts of about 580
tokens. Each is one build (`python -m jobs.build_dataset ... --set runtime.local=true`) under
`/usr/bin/time -v`, one after the other, N 16, T 64, rows_in_flight 64, the reward model alone. It
prints each run's peak RSS, wall time and the generator's KV figures (from `_report.json`), and the
two differences the issue targets (at most 0.5 GB each).

    python -m benchmarks.kv_memory --models .cache/real-models --json benchmarks/results/kv-memory-cpu.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import write_json

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "configs" / "prompts" / "ifeval-eval.jsonl"


def _rows() -> list[dict]:
    return [json.loads(line) for line in SOURCE.read_text().splitlines() if line.strip()]


def _long(rows: list[dict], tokenizer, tokens: int, start: int) -> str:
    """A prompt of about ``tokens`` tokens: the eval prompts from ``start`` on, joined, then cut."""
    text, i = "", start
    while len(tokenizer(text).input_ids) < tokens:
        text += rows[i % len(rows)]["prompt"] + "\n\n"
        i += 1
    ids = tokenizer(text).input_ids[:tokens]
    return tokenizer.decode(ids) + "\n\nAnswer the last request only."


def prompt_sets(tokenizer, folder: Path) -> dict[str, Path]:
    rows = _rows()
    short = [{"prompt": r["prompt"]} for r in rows[:16]]
    sets = {"short16": short,
            "short16+long1700": short + [{"prompt": _long(rows, tokenizer, 1700, 16)}],
            "medium580x8": [{"prompt": _long(rows, tokenizer, 580, 16 + 8 * k)} for k in range(8)]}
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, prompts in sets.items():
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return paths


def run(name: str, prompts: Path, models: Path, output: Path, extra: list[str]) -> dict:
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "jobs.build_dataset", "--config", "configs/real.yaml",
               "--prompts", str(prompts), "--output", str(output / name), "--no-progress", "--strategy", "sbon",
               "--num-samples", "16", "--max-new-tokens", "64",
               "--set", "runtime.local=true", "--set", "runtime.rows_in_flight=64",
               "--set", f"models.generator={models / 'generator'}",
               "--set", f"models.reward=[{models / 'reward'}]", "--set", "models.reward_weights=[1.0]", *extra]
    subprocess.run(["rm", "-rf", str(output / name)], check=True)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{name}: the build failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    report = json.loads((output / name / "_report.json").read_text())
    return {"run": name, "peak_rss_gb": round(rss_kb / 2**20, 3), "wall_seconds": round(wall, 1),
            "pairs": report["pairs"], "generated_tokens": report["generated_tokens"],
            "generator_kv": report.get("generator_kv"), "reward_kv": report.get("reward_kv"),
            "reward_tokens_read": _run_stats(output / name).get("reward_tokens_read")}


def _run_stats(folder: Path) -> dict:
    """The build's run_stats, from its manifest."""
    return json.loads((folder / "_manifest.json").read_text()).get("run_stats") or {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=".cache/real-models", help="make real-models' folder")
    parser.add_argument("--output", default="out/bench/kv-memory")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--set", action="append", default=[], help="more --set overrides for every build")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    models, output = Path(args.models).resolve(), Path(args.output).resolve()
    tokenizer = AutoTokenizer.from_pretrained(models / "generator")
    paths = prompt_sets(tokenizer, output / "prompts")
    extra = [item for value in args.set for item in ("--set", value)]
    results = [run(name, path, models, output, extra) for name, path in paths.items()]
    base = results[0]["peak_rss_gb"]
    print(f"{'run':<20} {'peak RSS GB':>12} {'vs short16':>11} {'wall s':>8} {'KV peak GB':>11} {'shared GB':>10} "
          f"{'reward KV peak GB':>18} {'reward shared GB':>17}")
    for r in results:
        kv = (r["generator_kv"] or [{}])[0]
        reward = (r["reward_kv"] or [{}])[0]
        print(f"{r['run']:<20} {r['peak_rss_gb']:>12.3f} {r['peak_rss_gb'] - base:>+11.3f} {r['wall_seconds']:>8.1f} "
              f"{kv.get('kv_bytes_peak', 0) / 2**30:>11.3f} {kv.get('kv_prompt_bytes_shared', 0) / 2**30:>10.3f} "
              f"{reward.get('kv_bytes_peak', 0) / 2**30:>18.3f} {reward.get('kv_prompt_bytes_shared', 0) / 2**30:>17.3f}")
    write_json(args.json, {"command": " ".join(sys.argv), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

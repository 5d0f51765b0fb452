"""Quality figures from the judges (pipeline.judge: IFEval's, IFBench's): a build's pairs, or decoding methods.

    bon-evaluate --pairs OUT [--prompts FILE] [--allow-partial] [--report FILE]
    bon-evaluate --generator DIR --reward DIR --prompts FILE [--methods greedy,temperature,...]
        [--max-new-tokens T] [--num-prompts P] [--num-samples N] [--search-depth D] [--search-width K]
        [--step-size N] [--sla-temperature T] [--seed S] [--device cpu|cuda] [--dtype float32] [--report FILE]
    (or python -m jobs.evaluate ...)

With --pairs: the pairs of the build at OUT (a bon-build --output), read through its output store (committed shards
only; an unfinished build only with --allow-partial). Each pair is judged against its
instruction_id_list and kwargs columns (kept from the input by data.extra_columns), or, where the
build has none, against the row of --prompts (IFEval's columns: prompt, instruction_id_list, kwargs)
whose prompt is the pair's raw_prompt. Prints, per judge, the prompt-level and instruction-level
strict accuracy of the chosen and of the rejected responses, and pair accuracy: among the pairs the
judge tells apart, the share where the chosen response follows more instructions. Each pair is
judged by the judge whose registry holds its instructions: IFEval's, or IFBench's for pairs built
from IFBench prompts (configs/prompts/ifbench-test.jsonl), reported with the size of IFBench's
judged subset; an IFBench pair outside it is counted, not judged.

With --generator: decoding methods against greedy (pipeline.evaluation) on the --prompts rows, each
response judged (IFEval or IFBench, one judge per run) against its row's instructions; --reward is
the reward model the strategies choose candidates with (it judges nothing). --generator is the
policy (a Reward Transformer directory for `sla`). Methods: the baselines greedy, temperature,
top_p, top_k and beam, and every strategy of the registry (pipeline.strategies); default: the
baselines, sla and sbon. A strategy whose registry check fails on --generator (sla without a
trained reward channel) is refused when named, and skipped with a note by default. Prints win /
tie / loss against greedy, the win rate (wins + ties/2, Table 1 of the SLA paper), the judge's
strict accuracy and the decoding cost relative to greedy (tokens and wall time).

Either way --report FILE gets the figures as JSON. User errors print one line on stderr and exit
with code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

from jobs.cli import add_device_flags, exits_on_interrupt, job_parser, setup_logging, strategies_text
from pipeline.errors import InputError

log = logging.getLogger(__name__)
INSTRUCTION_COLUMNS = ["instruction_id_list", "kwargs"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (module docstring); the methods' list comes from pipeline.evaluation and
    the strategy registry (pipeline.strategies)."""
    from pipeline.evaluation import CHOICES, DEFAULT_METHODS, SAMPLING

    epilog = (f"methods (--methods): the baselines {', '.join([*SAMPLING, 'beam'])}, and the strategies:\n"
              f"{strategies_text().split(chr(10), 1)[1]}\n"
              f"default: {','.join(DEFAULT_METHODS)} (a strategy --generator cannot serve is skipped)\n"
              "exit codes: 0 done; 2 a user error (input, models, methods), one line on stderr")
    parser = job_parser("bon-evaluate", __doc__, epilog=epilog)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--pairs", help="a build's output (directory or s3:// prefix): judge its pairs")
    source.add_argument("--generator", help="policy or Reward Transformer directory: compare decoding methods")
    parser.add_argument("--prompts", default=None, help="JSONL/Parquet with prompt, instruction_id_list, kwargs")
    parser.add_argument("--allow-partial", action="store_true", help="read an unfinished build's committed shards")
    parser.add_argument("--report", default=None, help="write the figures as JSON here")
    parser.add_argument("--reward", default=None, help="with --generator: the reward model the methods choose with")
    parser.add_argument("--prompt-column", default="prompt", help="the column of --prompts that holds the prompt")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated subset of {','.join(CHOICES)} (default: see below)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="token cap of each response")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="evaluate the first P valid prompts (default: all)")
    parser.add_argument("--num-samples", type=int, default=8,
                        help="N of the sampling strategies (sbon, best_of_n, ...)")
    parser.add_argument("--search-depth", type=int, default=2, help="SLA d")
    parser.add_argument("--search-width", type=int, default=2, help="SLA k")
    parser.add_argument("--step-size", type=int, default=10, help="SLA n")
    parser.add_argument("--sla-temperature", type=float, default=1.0, help="temperature of SLA's sampled children")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled methods' per-row seeds")
    add_device_flags(parser)
    return parser.parse_args(argv)


def read_instructions(uri: str, column: str) -> dict[str, dict]:
    """{prompt text (a conversation: its canonical JSON, as a build's raw_prompt holds it): the row's
    instruction columns} for every row of the prompt file."""
    from pipeline.data.chat import conversation_text
    from pipeline.data.readers import PromptSource

    rows = {}
    for prompt, columns in PromptSource(uri, column, extra_columns=INSTRUCTION_COLUMNS).records():
        if isinstance(prompt, (str, list)):
            rows[prompt if isinstance(prompt, str) else conversation_text(prompt)] = columns
    return rows


def read_pairs(output: str, allow_partial: bool) -> list[dict]:
    """The build's pair rows, from its committed shards only (OutputReader.read_committed); with
    ``allow_partial``, one line on stderr says what of the build was left out. InputError when
    ``output`` is no build."""
    from pipeline.data.reader import BUILD_FILES, OutputReader, partial_read_line, read_parquet

    store = OutputReader.open_build(output)
    if store is None:
        raise InputError(f"{output}: not a build's output (none of {', '.join(BUILD_FILES)}); --pairs takes a "
                         "bon-build --output")
    read = store.read_committed(allow_partial=allow_partial)
    rows = []
    for part in read.parts:
        rows += read_parquet(store.fs, part).to_pylist()
    line = partial_read_line(output, len(rows), [read])
    if line:
        log.info("%s", line)
    return rows


def judge_pairs(args) -> dict:
    """The --pairs figures; InputError (one line) for what the user can fix."""
    from pipeline.errors import CorruptMarker, IncompleteBuild
    from pipeline.evaluation import evaluate_pairs, instructions

    try:
        rows = read_pairs(args.pairs, args.allow_partial)
    except (IncompleteBuild, CorruptMarker) as exc:
        raise InputError(str(exc)) from None
    if not rows:
        raise InputError(f"{args.pairs}: no committed pairs")
    asked = read_instructions(args.prompts, args.prompt_column) if args.prompts else None
    pairs = []
    for row in rows:
        where = f"{args.pairs}: pair {row.get('prompt_id')}"
        try:
            found = instructions(row)
            if found is None and asked is not None:
                if row["raw_prompt"] not in asked:
                    raise InputError(f"{where}: its prompt {row['raw_prompt'][:60]!r} is not in {args.prompts}")
                found = instructions(asked[row["raw_prompt"]])
        except ValueError as exc:
            raise InputError(f"{where}: {exc}") from None
        if found is None:
            raise InputError(f"{where}: no instruction_id_list/kwargs columns; pass --prompts FILE with them")
        pairs.append({"prompt": row["raw_prompt"], "chosen": row["chosen"], "rejected": row["rejected"],
                      "instruction_id_list": found[0], "kwargs": found[1]})
    try:
        report = evaluate_pairs(pairs)
    except ValueError as exc:  # an instruction the judge does not know, or kwargs it cannot take
        raise InputError(f"{args.pairs}: {exc}") from None
    return {"output": args.pairs, "prompts": args.prompts, **report}


def load_prompts(uri: str, column: str, tokenizer, max_new_tokens: int, limit: int | None):
    """The valid rows of the prompt file as PromptInputs (with their instruction columns), the
    first ``limit`` of them when given."""
    from pipeline.data.chat import PromptFormatter
    from pipeline.data.prompts import validate
    from pipeline.data.readers import PromptSource

    records = list(PromptSource(uri, column, extra_columns=INSTRUCTION_COLUMNS).records())
    rows, _ = validate([v for v, _ in records], column, columns=[c for _, c in records])
    formatter = PromptFormatter(tokenizer, tokenizer.model_max_length - max_new_tokens)
    prompts = [p for p, _, _ in map(formatter.prepare, rows) if p is not None]
    return prompts[:limit] if limit else prompts


FLAGS = {"models.generator": "--generator", "models.reward": "--reward"}
"""The config keys a strategy's model check names, as this job's flags."""


def servable(method: str, args, sla_params) -> str | None:
    """Why --generator cannot serve ``method`` (one line naming the flag), or None when it can: a
    baseline always can; a strategy when its registry record's model check passes (SLA: a trained
    reward channel), with the settings the comparison runs it with."""
    from pipeline.preflight import MODEL_FILES
    from pipeline.config import ConfigError, ModelsConfig
    from pipeline.evaluation import strategy_settings
    from pipeline.strategies import STRATEGIES

    record = STRATEGIES.get(method)
    if record is None or record.check_models is None:
        return None
    params, _, _ = strategy_settings(record, args.max_new_tokens, sla_params, args.sla_temperature, args.num_samples)
    try:
        record.check_models(params, ModelsConfig(generator=args.generator, reward=args.reward), MODEL_FILES)
    except ConfigError as exc:
        # The check names the config key (models.generator); this job's user set its flag.
        key, _, why = str(exc).partition(": ")
        return f"{FLAGS.get(key, key)}: {why}"
    return None


def compare_methods(args) -> tuple[dict, str] | int:
    """The --generator figures and their table, or exit code 2 after one line on stderr."""
    from pipeline.config import ConfigError
    from pipeline.decoding.sla import SLAParams
    from pipeline.evaluation import CHOICES, DEFAULT_METHODS, compare, format_report, judge_name
    from pipeline.judge import ifbench_subset, ifbench_subset_text

    try:
        for flag in ("reward", "prompts"):
            if getattr(args, flag) is None:
                raise ConfigError(f"--{flag}: required with --generator")
        sla_params = SLAParams(args.search_depth, args.search_width, args.step_size)
        if args.methods:
            methods = [m.strip() for m in args.methods.split(",") if m.strip()]
            unknown = [m for m in methods if m not in CHOICES]
            if unknown:
                raise ConfigError(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(CHOICES)}")
            for method in methods:
                why = servable(method, args, sla_params)
                if why:
                    raise ConfigError(why)
        else:
            methods = []
            for method in DEFAULT_METHODS:
                why = servable(method, args, sla_params)
                if why:
                    log.info("note: %s skipped (%s)", method, why)
                else:
                    methods.append(method)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2

    from transformers import AutoConfig

    from pipeline.engines.hf import HFEngine
    from pipeline.engines.rewards import RewardScorer

    for flag, path in (("--generator", args.generator), ("--reward", args.reward)):
        try:
            AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as exc:
            log.error("%s: cannot load %r (%s)", flag, path, str(exc).splitlines()[0])
            return 2
    engine = HFEngine.from_pretrained(args.generator, device=args.device, dtype=args.dtype)
    try:
        prompts = load_prompts(args.prompts, args.prompt_column, engine.tokenizer, args.max_new_tokens,
                               args.num_prompts)
    except InputError as exc:
        log.error("%s", exc)
        return 2
    if not prompts:
        log.error("%s: no valid prompts", args.prompts)
        return 2
    reward = RewardScorer.from_pretrained(args.reward, device=args.device, dtype=args.dtype)
    try:
        judge = judge_name(prompts)
        report = compare(engine, reward, prompts, methods, args.max_new_tokens, args.seed, sla_params=sla_params,
                         sla_temperature=args.sla_temperature, num_samples=args.num_samples)
    except ValueError as exc:  # a prompt without instructions, or ones the judge cannot check
        log.error("%s: %s", args.prompts, exc)
        return 2
    # IFBench's figures carry the size of the subset they come from.
    subset = {"ifbench_subset": ifbench_subset()} if judge == "IFBench" else {}
    table = (f"{len(prompts)} prompts, judged by {judge} (strict"
             + (f"; {ifbench_subset_text()}" if subset else "") + f"), against greedy\n{format_report(report)}")
    return {"prompts": len(prompts), "generator": args.generator, "reward": args.reward,
            "judge": f"{judge.lower()}-strict", **subset, "methods": report}, table


@exits_on_interrupt("nothing written; rerun the same command to start again")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    if args.pairs:
        from pipeline.evaluation import format_pairs_report

        try:
            report = judge_pairs(args)
        except InputError as exc:
            log.error("%s", exc)
            return 2
        table = format_pairs_report(report)
    else:
        result = compare_methods(args)
        if isinstance(result, int):
            return result
        report, table = result
    print(table)
    if args.report:
        with open(args.report, "w") as f:
            # NaN (no pair told apart) as null: the file stays strict JSON.
            json.dump(_finite(report), f, indent=2)
    return 0


def _finite(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    sys.exit(main())

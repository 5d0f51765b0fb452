"""The dataset card (OUT/README.md): the one place that writes it.

A finished build's card is a Hugging Face dataset card: YAML front matter whose ``configs:`` name
the committed files (``front_matter``: ``default`` the pairs, ``rejects`` the input rows without a
pair, ``quarantine`` the candidates with a non-finite reward; each one split, ``train``), then
Markdown: what the dataset is, its columns with their types and meanings, the counts, how to load it
with ``datasets`` and TRL's DPOTrainer, and where it came from (the manifest's provenance,
pipeline.provenance). So ``datasets.load_dataset(OUT)`` reads exactly the committed pairs, and
``load_dataset(OUT, "rejects")`` the rejects. ``load_dataset("parquet", data_dir=OUT)`` reads no
card: it picks the pair files by the split keyword in their names (``train-NNNNN.parquet``;
pipeline.data.store says why nothing else in OUT matches).

While a build runs, its output store (pipeline.data.store.OutputStore) keeps the card current through
``check_slot`` and ``write_progress``; the finished build writes the full card with ``write_card``.
Every function here takes that store (its filesystem, the shards the card names in ``card_shards``,
``card_blocked``); this module imports no store, no config, no engine and no strategy: a card is
written from the store and the manifest alone.
"""

from __future__ import annotations

import json
import logging
import time

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.layout import part_name, side_name
from pipeline.data.storage import join

log = logging.getLogger(__name__)

CARD_NAME = "README.md"
CARD_TAG = "# bon-pipeline dataset card"
"""The card's second line (a YAML comment in its front matter): a README.md that starts with
``---`` and this is ours to rewrite or remove; any other is the user's."""
CARD_CONFIGS = (("default", "", part_name, "rows"), ("rejects", "_rejects", side_name, "rejects"),
                ("quarantine", "_quarantine", side_name, "quarantine"))
"""The card's configs: (name, directory, file name of a shard, the marker's entry with its rows)."""

COLUMNS = {
    "prompt_id": "first 16 hex digits of the sha256 of the prompt text: a prompt's key across builds",
    "prompt": "the prompt as the model saw it (standard: its text, chat template applied when "
              "sampling.chat_template allows; conversational: its messages)",
    "chosen": "the candidate with the highest reward (no EOS token)",
    "rejected": "the candidate with the lowest reward: a finished one unless data.rejected is any (no EOS token)",
    "chosen_score": "reward of the chosen completion",
    "rejected_score": "reward of the rejected completion (a partial one's at its stop when rejected_is_partial)",
    "chosen_scores": "the chosen completion's score under each reward of models.reward, in its order "
                     "(chosen_score is their weighted sum)",
    "rejected_scores": "the rejected completion's score under each reward of models.reward, in its order",
    "strategy": "decoding method that produced the candidates (best_of_n, sbon, sla, dsbd, ults, aded)",
    "num_candidates": "candidates generated for the prompt (N)",
    "generated_tokens": "tokens generated for this prompt, all candidates",
    "bon_equivalent_tokens": "tokens plain Best-of-N at the same N would have generated (an estimate)",
    "rejected_is_partial": "the rejected completion was stopped early by speculative rejection",
    "chosen_sample": "index of the chosen candidate among the N",
    "rejected_sample": "index of the rejected candidate among the N",
    "stopped_early": "candidates stopped early (speculative rejection)",
    "failed_candidates": "candidates with no usable reward (non-finite: see the quarantine config)",
    "raw_prompt": "the prompt text as read from the input",
    "prompt_truncated": "the prompt was cut to fit the model's context (data.overlength truncate)",
    "source_row": "row number of the prompt in the input (0-based)",
    "prompt_token_ids": "token ids of the prompt",
    "chosen_token_ids": "token ids of the chosen completion",
    "rejected_token_ids": "token ids of the rejected completion",
    "candidate_scores": "every candidate's score by sample index (data.candidate_scores; partial for one "
                        "stopped early, NaN if failed)",
    "candidate_tokens": "every candidate's generated tokens by sample index (data.candidate_scores)",
    "candidate_stopped_early": "whether each candidate was stopped early, by sample index (data.candidate_scores)",
}
"""The meaning of each pair column (pipeline.data.schema.PAIR_SCHEMA); any other column is one of
the input's (data.extra_columns)."""

def reward_weights(manifest: dict) -> list[tuple[str, float]]:
    """(reward, weight) of each reward a build's manifest names, in models.reward's order."""
    models = manifest.get("config", {}).get("models", {})
    specs = models.get("reward") if isinstance(models.get("reward"), list) else [models.get("reward")]
    weights = models.get("reward_weights") or [1.0] * len(specs)
    return list(zip(specs, weights))


def _type_name(found: pa.DataType) -> str:
    if pa.types.is_list(found) and pa.types.is_struct(found.value_type):
        return "list of {" + ", ".join(f"{f.name}: {f.type}" for f in found.value_type) + "} (messages)"
    return str(found)


def card_body(manifest: dict, schema: pa.Schema, uri: str) -> str:
    """The card's Markdown (after the front matter) for a finished build: ``manifest`` as the build
    writes it (with "provenance"), ``schema`` of its pair files, ``uri`` the output."""
    config, prov = manifest.get("config", {}), manifest.get("provenance", {})
    strategy = config.get("strategy", {}).get("name", "?")
    output_format = config.get("data", {}).get("output_format", "standard")
    models = prov.get("models", {})
    generator = (models.get("generator") or {}).get("model", config.get("models", {}).get("generator"))
    rewards = reward_weights(manifest)
    reward = (f"`{rewards[0][0]}`" if len(rewards) == 1 and rewards[0][1] == 1.0 else
              "the weighted sum of " + " + ".join(f"{w:g} x `{r}`" for r, w in rewards)
              + " (`chosen_scores` and `rejected_scores` keep each reward's score, in this order)")
    reasons = manifest.get("reject_reasons") or {}
    lines = [
        "", "# Preference pairs (chosen / rejected) for DPO", "",
        f"Built by [bon-pipeline](#provenance) with the `{strategy}` strategy: for each prompt, "
        f"{config.get('sampling', {}).get('num_samples', '?')} candidate responses from `{generator}`, scored "
        f"by {reward}; the best is `chosen`, the worst `rejected`. TRL's {output_format} format "
        "(`prompt`, `chosen`, `rejected`), read by `DPOTrainer` as it is.", "",
        *([f"**This build made no pairs.** `load_dataset(\"{uri}\")` stops on a missing file named for "
           "that; the rejected rows below say why, and "
           f"`load_dataset(\"parquet\", data_files=\"{uri}/_rejects/*.parquet\")` reads them.", ""]
          if manifest.get("pairs") == 0 else []),
        "## Counts", "",
        "| | |", "| --- | --- |",
        f"| input rows | {manifest.get('prompts_in')} |",
        f"| pairs | {manifest.get('pairs')} |",
        f"| rejected rows | {manifest.get('prompts_rejected')}"
        + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(reasons.items()))})" if reasons else "") + " |",
        f"| quarantined candidates (non-finite reward) | {manifest.get('candidates_quarantined', 0)} |",
        f"| generated tokens | {manifest.get('generated_tokens')} (Best-of-N estimate: "
        f"{manifest.get('bon_equivalent_tokens')}) |",
        f"| shards | {manifest.get('shards')} |", "",
        "## Columns", "",
        "| column | type | meaning |", "| --- | --- | --- |",
        *(f"| `{field.name}` | {_type_name(field.type)} | "
          f"{COLUMNS.get(field.name, 'a column of the input (data.extra_columns)')} |" for field in schema),
        "",
        "## Load it", "",
        "```python",
        "from datasets import load_dataset",
        f'pairs = load_dataset("{uri}", split="train")               # the pairs (this card\'s default config)',
        f'rejects = load_dataset("{uri}", "rejects", split="train")  # input rows without a pair, with the reason',
        f'same = load_dataset("parquet", data_dir="{uri}", split="train")  # by file name: train-*.parquet',
        "",
        "from trl import DPOConfig, DPOTrainer",
        'trainer = DPOTrainer(model=model, args=DPOConfig(output_dir="dpo"), train_dataset=pairs,',
        "                     processing_class=tokenizer)",
        "```", "",
        "The pair files are named `train-NNNNN.parquet` (one per input shard) because "
        '`load_dataset("parquet", data_dir=...)` reads no card and picks files by the split name in them; '
        "nothing else here has a split name. Configs `rejects` and `quarantine` are listed only when they have "
        "rows. `_markers/` holds each shard's commit record, `_manifest.json` the totals and this provenance, "
        "`_SUCCESS` marks the build finished.", "",
        "## Provenance", "",
        "| role | model | revision asked | found |", "| --- | --- | --- | --- |",
    ]
    lines += _model_rows(models)
    packages = prov.get("packages", {})
    source = manifest.get("input")
    if source:
        lines += ["", "Input: " + ", ".join(f"{k} `{v}`" for k, v in source.items() if v is not None) + "."]
    lines += [
        "",
        "Packages: " + ", ".join(f"{k} {v}" for k, v in packages.items() if v is not None) + ".", "",
        f"Built {prov.get('date')} from code at git commit `{prov.get('git_commit')}`; config hash "
        f"`{manifest.get('config_hash')}`.", "",
        "Command:", "", "```", prov.get("command", ""), "```", "",
        "Config (credentials redacted):", "", "```json",
        json.dumps(prov.get("config", config), indent=2, sort_keys=True), "```", "",
    ]
    return "\n".join(lines)



def _model_rows(models: dict) -> list[str]:
    """The provenance table's rows: per role, the model, the revision asked and what was found (a
    reward function's module hash, local weights' hash, or the Hub commit), with a reward's weight."""
    rows = []
    for role, found in models.items():
        if found is None:
            rows.append(f"| {role} | (none) | | |")
            continue
        if found.get("kind") == "reward function":
            what = f"module sha256 `{found.get('module_sha256')}`"
        elif found.get("kind") == "local":
            what = f"weights sha256 `{found.get('weights_sha256')}` ({', '.join(found.get('weights_files', []))})"
        else:
            what = (f"commit `{found['commit']}`" if found.get("commit")
                    else f"commit unknown: {found.get('commit_reason')}")
        if "weight" in found:
            what += f"; weight {found['weight']:g}"
        rows.append(f"| {role} | `{found['model']}` | {found.get('revision') or 'default'} | {what} |")
    return rows

def check_slot(store) -> None:
    """Whether README.md is free or ours (CARD_TAG); a user's stays, and no card is written."""
    path = join(store.root, CARD_NAME)
    store._refresh()
    if not store.fs.exists(path):
        return
    with store.fs.open(path, "rb") as f:
        head = f.read(len(CARD_TAG) + 8)
    if not head.startswith(f"---\n{CARD_TAG}".encode()):
        store.card_blocked = (f"{join(store.uri, CARD_NAME)}: not a dataset card this pipeline wrote; it is left "
                              "as it is and no card is written, so datasets.load_dataset(OUT) does not see this "
                              "build's configs (move the file away to get the card)")
        log.warning("%s", store.card_blocked)


NO_PAIRS = "NO PAIRS - this build made none (README.md and _manifest.json say why)"
"""The pair config's path in the card of a finished build with no pairs: ``datasets`` cannot
load an empty split ("corresponds to no data"), so ``load_dataset(OUT)`` stops on a missing
file whose name says why."""


def front_matter(store, final: bool = False) -> str:
    """The card's YAML front matter: one config per kind of file (``default``: the pairs,
    ``rejects``, ``quarantine``), each naming the files of the shards in ``card_shards``, one
    split ``train``. The side configs name only files with rows, and are left out when there are
    none (``datasets`` refuses a config whose split has no row). The pairs are named by the glob
    ``train-*.parquet`` whenever the pair files on disk are exactly the committed ones (always,
    since a pair file gets its name only at its commit: ``commit_shard``), so a reader of a
    large output resolves one pattern and ``load_dataset(OUT)`` reads what
    ``load_dataset("parquet", data_dir=OUT)`` does. The side files are written before their
    shard commits, so their configs name files while the build runs, and are globbed only when
    ``final`` (the build is done and nothing writes any more). A finished build with no pair at
    all has one config, naming NO_PAIRS."""
    import yaml

    shards = store.card_shards or {}
    configs = []
    for name, directory, file_of, entry in CARD_CONFIGS:
        prefix = f"{directory}/" if directory else ""
        committed = [prefix + file_of(k) for k in sorted(shards)]
        rows = [(shards[k] if entry == "rows" else shards[k][entry])["rows"] for k in sorted(shards)]
        if name != "default":
            if not any(rows):
                continue
            committed = [f for f, n in zip(committed, rows) if n]
        paths: str | list[str] = committed
        if final or name == "default":
            pattern = "train-*.parquet" if not directory else f"{directory}/*.parquet"
            every = [prefix + p.rsplit("/", 1)[1] for p in store._ls(join(store.root, directory) if directory
                                                                     else store.root)]
            on_disk = {f for f in every if _glob_match(f.split("/")[-1], pattern.split("/")[-1])}
            kind = {prefix + file_of(k) for k in shards}
            if on_disk == kind:
                paths = pattern
        if name == "default" and final and not any(rows):
            # datasets resolves every config's files whichever is loaded, so the side configs
            # go too (the card says how to read the rejects without it).
            configs = [{"config_name": name, "data_files": [{"split": "train", "path": NO_PAIRS}],
                        "default": True}]
            break
        config = {"config_name": name, "data_files": [{"split": "train", "path": paths}]}
        if name == "default":
            config["default"] = True
        configs.append(config)
    return (f"---\n{CARD_TAG}: rewritten by every build of this output (edit the build, not this file)\n"
            + yaml.safe_dump({"configs": configs}, sort_keys=False, width=1000) + "---\n")


def write_progress(store) -> None:
    """The card of a build still running: the configs of the shards committed so far and a
    short note; none (ours removed) while no shard is committed."""
    if store.card_blocked or store.card_shards is None:
        return
    path = join(store.root, CARD_NAME)
    if not store.card_shards:  # (the first commit writes a card at once)
        if store.fs.exists(path):
            if store.lease is not None:
                store.lease.check()
            store.fs.rm(path)
        return
    pairs = sum(m["rows"] for m in store.card_shards.values())
    body = (f"\n# Preference pairs: build in progress\n\nThis build has not finished (no `_SUCCESS` yet). "
            f"The configs above name the {len(store.card_shards)} shard(s) committed when this card was written "
            f"({pairs} pairs); `datasets.load_dataset(\"{store.uri}\")` reads those and nothing else. The full "
            "card (columns, counts, provenance) is written when the build finishes.\n")
    store._write_bytes(path, (front_matter(store) + body).encode())
    store._card_written_at = time.time()


def write_final(store, body: str) -> bool:
    """The finished build's card: the front matter (``final``) and ``body`` (Markdown), to
    README.md; False when a README.md of the user's is in the way (``card_blocked``). A store
    that was not prepared names every committed shard (its markers)."""
    if store.card_shards is None:
        check_slot(store)
        store.card_shards = dict(store.iter_markers())
    if store.card_blocked:
        return False
    store._write_bytes(join(store.root, CARD_NAME), (front_matter(store, final=True) + body).encode())
    store._card_written_at = time.time()
    return True


def _glob_match(name: str, pattern: str) -> bool:
    """Whether a file name matches a card glob as ``datasets`` resolves it (hidden files never do)."""
    import fnmatch

    return not name.startswith(".") and fnmatch.fnmatchcase(name, pattern)


def write_card(store, manifest: dict) -> bool:
    """Write the finished build's card to ``store`` (an OutputStore; README.md), from its manifest;
    False when a README.md of the user's is in the way (``card_blocked``)."""
    shards = store.card_shards if store.card_shards is not None else store.markers()
    first = min(shards, default=None)
    schema = pa.schema([])
    if first is not None:
        with store.fs.open(join(store.root, store.pair_file(first, shards[first])), "rb") as f:
            schema = pq.read_schema(f)
    return write_final(store, card_body(manifest, schema, store.uri))


__all__ = ["CARD_NAME", "CARD_TAG", "COLUMNS", "NO_PAIRS", "card_body", "check_slot", "front_matter", "reward_weights",
           "write_card", "write_final", "write_progress"]

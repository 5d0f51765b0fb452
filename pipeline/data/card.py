"""The dataset card (OUT/README.md) and the build's provenance.

A finished build's card is a Hugging Face dataset card: YAML front matter whose ``configs:`` name
the committed files (OutputStore.card_front_matter: ``default`` the pairs, ``rejects`` the input
rows without a pair, ``quarantine`` the candidates with a non-finite reward; each one split,
``train``), then Markdown: what the dataset is, its columns with their types and meanings, the
counts, how to load it with ``datasets`` and TRL's DPOTrainer, and where it came from. So
``datasets.load_dataset(OUT)`` reads exactly the committed pairs, and ``load_dataset(OUT,
"rejects")`` the rejects. ``load_dataset("parquet", data_dir=OUT)`` reads no card: it picks the
pair files by the split keyword in their names (``train-NNNNN.parquet``; pipeline.data.store says
why nothing else in OUT matches).

Provenance (``provenance``; the manifest's "provenance" and the card's last section), computed once
per build on the driver, at plan time: each model's path or Hub id, the revision asked
(models.hf.revision) and what was found: a local directory's weights sha256 (``weights_sha256``,
cached on disk per state of the files), a Hub id's commit (the revision itself when it is one, else
asked of the Hub unless HF_HUB_OFFLINE, else the local Hugging Face cache's; null with a reason when
none knows), a reward function's module file sha256; package versions; the config with every
credential redacted; the command line, redacted; the date; the git commit of the code when it runs
from a checkout. What was found of each model is also the build's identity (``model_identity``,
pipeline.build.build_identity), which every commit marker records and a resume must match.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import Config, redact, redact_url
from pipeline.data.storage import join
from pipeline.data.store import OutputStore
from pipeline.engines.rewards import is_reward_function

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
}
"""The meaning of each pair column (pipeline.data.schema.PAIR_SCHEMA); any other column is one of
the input's (data.extra_columns)."""

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
PACKAGES = ("torch", "transformers", "ray", "vllm", "datasets", "trl", "pyarrow", "huggingface_hub", "bon-pipeline")
"""Distributions whose versions provenance records (None when not installed)."""

_weights_cache: dict[tuple, dict] = {}
"""weights_sha256 per (directory, its weight files' names, sizes and mtimes), in this process."""


def weights_cache_file() -> Path:
    """The on-disk cache of weight hashes: ``$BON_CACHE_DIR/weights-sha256.json``, by default under
    ``$XDG_CACHE_HOME`` (``~/.cache``)``/bon-pipeline``. One entry per model directory and state of
    its weight files, so a model is read once per change of its files, not once per build."""
    root = os.environ.get("BON_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "bon-pipeline")
    return Path(root) / "weights-sha256.json"


def _read_weights_cache(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _write_weights_cache(path: Path, entry: str, value: dict) -> None:
    """Add one entry (best effort: a read-only home only costs a rehash next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        found = _read_weights_cache(path)
        found[entry] = value
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(found, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


def weights_sha256(path: str) -> dict:
    """The weights of a local model directory (or one weight file): sha256 over its weight files
    (WEIGHT_SUFFIXES, at the top of the directory) in name order, each as its name, a NUL byte and
    its bytes, read in blocks; with the files' names and total size. Computed once per state of the
    files (path, names, sizes, mtimes) and kept in this process and in ``weights_cache_file()``: a
    build's start does not reread gigabytes of unchanged weights."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.iterdir()
                                                 if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    key = (str(root.resolve()), tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    if key not in _weights_cache:
        cache = weights_cache_file()
        entry = hashlib.sha256(json.dumps(key).encode()).hexdigest()
        found = _read_weights_cache(cache).get(entry)
        if not (isinstance(found, dict) and {"weights_sha256", "weights_files", "weights_bytes"} <= set(found)):
            digest = hashlib.sha256()
            for file in files:
                digest.update(file.name.encode() + b"\0")
                with open(file, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
            found = {"weights_sha256": digest.hexdigest() if files else None,
                     "weights_files": [p.name for p in files],
                     "weights_bytes": sum(p.stat().st_size for p in files)}
            _write_weights_cache(cache, entry, found)
        _weights_cache[key] = found
    return dict(_weights_cache[key])


def model_provenance(spec: str | None, revision: str | None) -> dict | None:
    """Where one model came from: its ``spec`` (models.<role>), the revision asked, and what could
    be found of what was loaded (see the module docstring); None for an unset model."""
    if not spec:
        return None
    out: dict = {"model": spec, "revision": revision}
    if is_reward_function(spec):
        module = spec.partition(":")[0]
        try:
            origin = importlib.util.find_spec(module).origin
        except (ImportError, AttributeError, ValueError):
            origin = None
        out.update(kind="reward function", module_file=origin,
                   module_sha256=_file_sha256(origin) if origin and os.path.isfile(origin) else None)
    elif os.path.exists(spec):
        out.update(kind="local", **weights_sha256(spec))
    else:
        out.update(kind="hub", **_hub_commit(spec, revision))
    return out


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _hub_commit(repo_id: str, revision: str | None) -> dict:
    """The commit of ``repo_id`` at ``revision``: the revision itself when it is a full commit hash;
    else asked of the Hub (unless HF_HUB_OFFLINE), which knows where a branch such as ``main`` is
    now; else the local Hugging Face cache's."""
    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        return {"commit": revision, "commit_reason": None}
    if not os.environ.get("HF_HUB_OFFLINE"):
        try:
            from huggingface_hub import HfApi

            return {"commit": HfApi().model_info(repo_id, revision=revision, timeout=10).sha, "commit_reason": None}
        except Exception:  # noqa: BLE001 - no network, no access, a bad id: the cache may still know
            pass
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except Exception as exc:  # noqa: BLE001 - an invalid id, no huggingface_hub: provenance says so
        return {"commit": None, "commit_reason": f"cannot look it up ({type(exc).__name__}: {str(exc)[:120]})"}
    if isinstance(found, str) and Path(found).parent.parent.name == "snapshots":
        return {"commit": Path(found).parent.name, "commit_reason": None}
    return {"commit": None, "commit_reason": "not on the Hub from here nor in the local Hugging Face cache (the "
                                             "workers resolved it; pin models.hf.revision to a commit to record it)"}


def models_provenance(config: Config) -> dict:
    """``model_provenance`` of each model the build loads: generator, reward, and the draft for the
    strategies that draft with a model. A composite reward (models.reward a list) gives one entry
    per reward, ``reward[0]``, ``reward[1]``, ..., each with its ``weight``."""
    from pipeline.strategies import lookup

    models = config.models
    uses_draft = lookup(config.strategy.name).uses_draft
    out = {"generator": model_provenance(models.generator, models.hf.revision_of("generator"))}
    if isinstance(models.reward, list):
        out.update({f"reward[{i}]": {**(model_provenance(spec, models.hf.revision_of("reward")) or {}), "weight": weight}
                    for i, (spec, weight) in enumerate(zip(models.rewards, models.weights))})
    else:
        out["reward"] = model_provenance(models.reward, models.hf.revision_of("reward"))
    if uses_draft:
        out["draft"] = model_provenance(models.draft, models.hf.revision_of("draft"))
    return out


def reward_weights(manifest: dict) -> list[tuple[str, float]]:
    """(reward, weight) of each reward a build's manifest names, in models.reward's order."""
    models = manifest.get("config", {}).get("models", {})
    specs = models.get("reward") if isinstance(models.get("reward"), list) else [models.get("reward")]
    weights = models.get("reward_weights") or [1.0] * len(specs)
    return list(zip(specs, weights))


def model_identity(found: dict | None) -> str | None:
    """What a model's provenance says was loaded, as one comparable string (None: nothing set):
    a reward function's module sha256, a local model's weights sha256, a Hub model's commit."""
    if found is None:
        return None
    if found.get("kind") == "reward function":
        return f"module sha256 {found.get('module_sha256')}"
    if found.get("kind") == "local":
        return f"weights sha256 {found.get('weights_sha256')}"
    return f"commit {found.get('commit')}" if found.get("commit") else f"commit unknown at revision {found.get('revision')}"


def package_versions() -> dict:
    """Python's and PACKAGES' versions (None for one not installed)."""
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _secret_name(name: str) -> bool:
    """A name (flag, config key) that holds a credential: one of its words is one of
    Config.SECRET_NAME_PARTS (``--hf-token``, ``aws_secret_access_key``; not ``max_new_tokens``)."""
    return any(word in Config.SECRET_NAME_PARTS for word in re.split(r"[^a-z0-9]+", name.lower()))


def redacted_command(argv: list[str]) -> str:
    """The command line, fit to be written: the value of a flag or ``key=value`` whose name holds
    a credential (``_secret_name``) is redacted, a JSON mapping value keeps only its non-credential
    entries, and a user:password in a URL goes."""
    out, hide_next = [], False
    for arg in argv:
        if hide_next:
            out.append("[redacted]")
            hide_next = False
        elif arg.startswith("-"):
            flag, eq, value = arg.partition("=")
            if not eq:
                hide_next = _secret_name(flag)
                out.append(arg)
            else:  # --flag=value, the value maybe key=value itself
                out.append(f"{flag}=[redacted]" if _secret_name(flag) else f"{flag}={_redacted_value(value)}")
        else:
            out.append(_redacted_value(arg))
    return shlex.join(out)


def _redacted_value(arg: str) -> str:
    """One argument that is no flag: ``key=value`` (``--set``'s) or a plain value."""
    name, eq, value = arg.partition("=")
    if eq and _secret_name(name):
        return f"{name}=[redacted]"
    if eq and value.lstrip().startswith(("{", "[")):
        try:
            return f"{name}={json.dumps(redact(json.loads(value)))}"
        except ValueError:  # not JSON: it may still hold a credential somewhere
            return f"{name}=[redacted]"
    return redact_url(arg)


def git_commit() -> str | None:
    """The commit of the code when it runs from a git checkout (None otherwise)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        found = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (found.stdout.strip() or None) if found.returncode == 0 else None


def provenance(config: Config, argv: list[str] | None = None, models: dict | None = None) -> dict:
    """Where a build came from (module docstring), for the manifest and the card. Redacted: the
    config as Config.redacted_dict() writes it (storage options and the free-form engine keywords),
    and the command line (redacted_command). ``models``: models_provenance(config), when the caller
    has it already (the build computes it at plan time, for its identity)."""
    config_dict = config.redacted_dict()
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(".py") and Path(argv[0]).parent.name == "jobs":  # python -m jobs.X
        argv[0:1] = ["python", "-m", f"jobs.{Path(argv[0]).stem}"]
    return {
        "models": models_provenance(config) if models is None else models,
        "packages": package_versions(),
        "config": config_dict,
        "command": redacted_command(argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
    }


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
    for role, found in models.items():
        if found is None:
            lines.append(f"| {role} | (none) | | |")
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
        lines.append(f"| {role} | `{found['model']}` | {found.get('revision') or 'default'} | {what} |")
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


def write_card(store: OutputStore, manifest: dict) -> bool:
    """Write the finished build's card to ``store`` (README.md), from its manifest; False when a
    README.md of the user's is in the way (OutputStore.card_blocked)."""
    shards = store.card_shards if store.card_shards is not None else store.markers()
    first = min(shards, default=None)
    schema = pa.schema([])
    if first is not None:
        with store.fs.open(join(store.root, store.pair_file(first, shards[first])), "rb") as f:
            schema = pq.read_schema(f)
    return store.write_card(card_body(manifest, schema, store.uri))


__all__ = ["COLUMNS", "card_body", "model_identity", "model_provenance", "models_provenance", "package_versions",
           "provenance", "redacted_command", "reward_weights", "weights_sha256", "weights_cache_file", "write_card"]

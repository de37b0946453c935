# Set-up is part of every target: a fresh clone needs only `make demo` or `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test test-fast test-compat bench bench-quality bench-agnostic bench-ruler bench-kvpress ablation env clean

$(STAMP): pyproject.toml setup.py
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

## The fast tests on the oldest supported transformers (5.17, the GPU machine's), in .venv-compat.
COMPAT_VENV ?= .venv-compat
test-compat:
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(COMPAT_VENV)/bin/python -m pip install --quiet "transformers==5.17.*" safetensors tqdm gguf accelerate numpy pytest hypothesis matplotlib
	$(COMPAT_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(COMPAT_VENV)/bin/python -m pytest -q -m "not slow" --ignore=tests/test_lm_eval.py

## Speed: prefill/selection overhead, eager and compiled decode, memory, bandwidth floor (eval/speed.py);
## then a long prompt's prefill, stock vs one-shot vs chunked compression, peak memory and time, one
## process per row (eval/prefill_memory.py; SmolLM2 at 8k tokens ~25 min, gemma-3-270m at 32k ~2 h on 1 core).
bench: $(STAMP)
	$(BIN)/python -m eval.speed
	$(BIN)/python -m eval.prefill_memory --model smollm2 --tokens 8000
	$(BIN)/python -m eval.prefill_memory --model gemma3-270m --tokens 32000
	$(BIN)/python tools/reselect_cost.py --config llama-8b --layers 4 --repeats 3

## Quality: every method x kept ratio x task setting, with plots (long; see eval/README.md; eval/quality.py).
bench-quality: $(STAMP)
	$(BIN)/python -m eval.quality

## The question asked after compression (issue 14): routes A and B beside window scoring, decode
## budgets 0.5 / 0.25 / 0.1 (eval/results/quality_<model>_heldout_agnostic.md).
bench-agnostic: $(STAMP)
	$(BIN)/python -m eval.quality --config eval/configs/quality_agnostic.json --no-fidelity --threads 1 --tag _agnostic

## RULER, the confirmation side (eval/ruler/README.md): both settings, kept 0.25 / 0.1, both models
## (long: see the README's cost section; results resume from eval/cache/).
bench-ruler: $(STAMP)
	$(BIN)/python -m eval.quality --config eval/configs/ruler.json --threads 1

## Jacap's knobs one at a time, on the tuning split of both models (eval/results/ablation_<model>.md).
ablation: $(STAMP)
	$(BIN)/python -m eval.quality --ablation --models smollm2 gemma3-270m --ratios 0.1 --threads 1

## kvpress's presses on the same prompts, in kvpress's own venv (it pins transformers<5.3), scored
## by our scorer and tabled beside our rows (eval/kvpress/README.md).
KVPRESS_VENV  ?= .venv-kvpress
KVPRESS_STAMP := $(KVPRESS_VENV)/.installed-stamp
KVPRESS_GRID  ?= --models smollm2 --ratios 0.1 --threads 1
KVPRESS_ROWS  ?= kvpress:snapkv kvpress:expected_attention
KVPRESS_OURS  := full jacap 'jacap (consensus 0.25)' snapkv pyramidkv adakv h2o tova knorm keydiff capkv kvzip streaming_llm random

$(KVPRESS_STAMP): eval/kvpress/requirements.txt
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(KVPRESS_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(KVPRESS_VENV)/bin/python -m pip install --quiet -r eval/kvpress/requirements.txt
	touch $(KVPRESS_STAMP)

bench-kvpress: $(STAMP) $(KVPRESS_STAMP)
	mkdir -p eval/cache
	$(BIN)/python -m eval.kvpress.bridge export eval/cache/kvpress_requests.json $(KVPRESS_GRID) --methods $(KVPRESS_ROWS)
	$(KVPRESS_VENV)/bin/python eval/kvpress/run_presses.py eval/cache/kvpress_requests.json eval/cache/kvpress_results.jsonl
	$(BIN)/python -m eval.kvpress.bridge merge eval/cache/kvpress_requests.json eval/cache/kvpress_results.jsonl
	$(BIN)/python -m eval.quality $(KVPRESS_GRID) --methods $(KVPRESS_OURS) $(KVPRESS_ROWS) --tag _kvpress

clean:
	rm -rf $(VENV) $(KVPRESS_VENV) $(COMPAT_VENV) build *.egg-info .pytest_cache

#!/usr/bin/env bash
# The lm-eval table of docs/results.md: SmolLM2 with stock `hf` and with `hf-jacap` at kept ratios 1.0, 0.25, 0.1
# on offline tasks (data from `python -m eval.make_tasks --model smollm2`).
# Usage: tools/lm_eval_table.sh [LIMIT] [TASKS]   (samples per task, default 4; tasks, default jacap_single_needle)
set -euo pipefail
cd "$(dirname "$0")/.."
LIMIT=${1:-4}
TASKS=${2:-jacap_single_needle}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
M=$(.venv/bin/python -c "from jacap_attn.models import ensure_model; print(ensure_model('smollm2'))")
[ -f eval/tasks/data/single_needle.jsonl ] || .venv/bin/python -m eval.make_tasks --model smollm2 --out eval/tasks/data --n 20 --context-tokens 1500 --seed 1234
OUT=eval/results/lm_eval
mkdir -p "$OUT"
run() { name=$1; shift; .venv/bin/lm_eval "$@" --tasks "$TASKS" --include_path eval/tasks --limit "$LIMIT" --batch_size 1 --output_path "$OUT/$name" > "$OUT/$name.log" 2>&1; echo "$name done"; }
run hf --model hf --model_args "pretrained=$M"
run hf-jacap-ratio1.0 --model hf-jacap --model_args "pretrained=$M,ratio=1.0"
run hf-jacap-ratio0.25 --model hf-jacap --model_args "pretrained=$M,ratio=0.25"
run hf-jacap-ratio0.1 --model hf-jacap --model_args "pretrained=$M,ratio=0.1"

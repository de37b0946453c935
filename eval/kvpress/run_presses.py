"""Run kvpress presses on exported prompts; runs in kvpress's own venv (``.venv-kvpress``).

Reads the requests written by ``python -m eval.kvpress.bridge export`` and writes one JSON line per
request. Imports only torch, transformers and kvpress (never ``jacap_attn``, whose transformers
pin differs). For each request the press compresses ``prompt_ids`` during an ordinary prefill
(``with press(model)``, as kvpress's own pipeline does), then:

* ``kind="task"``: greedy decoding of ``full_ids[prompt:]`` and then new tokens over the compressed
  cache, with the logical RoPE positions (kvpress's ``KVPressTextGenerationPipeline.generate_answer``
  loop), up to ``max_new`` tokens or EOS; the decoded text is returned;
* ``kind="fidelity"``: the continuation is teacher-forced over the compressed cache and over the
  full cache: mean KL(p_full || p_press) and the NLL increase, as ``python -m eval.quality`` does.

kvpress's ``compression_ratio`` is the *removed* fraction: ``1 - ratio`` for our kept ``ratio``.

    .venv-kvpress/bin/python eval/kvpress/run_presses.py REQUESTS.json RESULTS.jsonl
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch


def make_press(name: str, kwargs: dict, ratio: float):
    """The press ``name`` removing ``1 - ratio`` of the prompt. A ``"press"`` argument given as
    ``[inner name, inner arguments]`` is built first and wrapped (``AdaKVPress(press=SnapKVPress(...))``:
    the wrapper's compression ratio is its inner press's)."""
    import kvpress

    kwargs = dict(kwargs)
    inner = kwargs.pop("press", None)
    if inner is not None:
        inner_name, inner_kwargs = inner
        return getattr(kvpress, name)(press=getattr(kvpress, inner_name)(compression_ratio=1.0 - ratio, **inner_kwargs),
                                      **kwargs)
    return getattr(kvpress, name)(compression_ratio=1.0 - ratio, **kwargs)


def prefill(model, ids: torch.Tensor, press):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        if press is None:
            model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        else:
            with press(model):
                model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
    return cache


def positions(start: int, count: int) -> torch.Tensor:
    return torch.arange(start, start + count)[None]


def answer(model, tok, req, press) -> str:
    prompt = torch.tensor([req["prompt_ids"]])
    full = torch.tensor([req["full_ids"]])
    n = prompt.shape[1]
    cache = prefill(model, prompt, press)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = []
    with torch.no_grad():
        logits = model(input_ids=full[:, n:], past_key_values=cache, position_ids=positions(n, full.shape[1] - n),
                       logits_to_keep=1).logits
        pos = full.shape[1]
        for _ in range(req["max_new"]):
            token = int(logits[0, -1].argmax())
            out.append(token)
            if token in eos:
                break
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                           position_ids=positions(pos, 1)).logits
            pos += 1
    return tok.decode(out, skip_special_tokens=True)


def continuation_logp(model, prefix: torch.Tensor, cont: torch.Tensor, press) -> torch.Tensor:
    cache = prefill(model, prefix, press)
    n = prefix.shape[1]
    with torch.no_grad():
        logits = model(input_ids=cont[:, :-1], past_key_values=cache,
                       position_ids=positions(n, cont.shape[1] - 1)).logits[0].float()
    return torch.log_softmax(logits, -1)


def main(argv) -> int:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    import kvpress  # noqa: F401  # patches transformers' attention functions (head-wise masks: AdaKV) first

    requests_path, results_path = argv
    with open(requests_path) as f:
        spec = json.load(f)
    torch.set_num_threads(int(spec.get("threads", 2)))
    done = set()
    if os.path.exists(results_path):
        with open(results_path) as f:
            for line in f:
                # A blank line, or one cut off by an interrupted run: that request is done again.
                with contextlib.suppress(json.JSONDecodeError, KeyError):
                    done.add(json.loads(line)["key"])
    todo = [r for r in spec["requests"] if r["key"] not in done]
    if not todo:
        print(f"{results_path}: all {len(spec['requests'])} requests done", file=sys.stderr)
        return 0
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32,
                                                 attn_implementation="sdpa", local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(spec["model_dir"], local_files_only=True)
    references = {}
    with open(results_path, "a") as out:
        for req in tqdm(todo, desc=f"kvpress {spec['model']}", file=sys.stderr):
            press = make_press(req["press"], req["kwargs"], req["ratio"])
            if req["kind"] == "task":
                result = {"text": answer(model, tok, req, press)}
            else:
                prefix, cont = torch.tensor([req["prefix_ids"]]), torch.tensor([req["cont_ids"]])
                ref_key = (req["index"], len(req["prefix_ids"]))
                if ref_key not in references:
                    references[ref_key] = continuation_logp(model, prefix, cont, None)
                ref = references[ref_key]
                logp = continuation_logp(model, prefix, cont, press)
                target = cont[0, 1:, None]
                nll, ref_nll = float(-logp.gather(-1, target).mean()), float(-ref.gather(-1, target).mean())
                kl = float((ref.exp() * (ref - logp)).sum(-1).mean())
                result = {"kl": kl, "nll": nll, "nll_increase": nll - ref_nll}
            out.write(json.dumps({"key": req["key"], **result}) + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Passkey sweep on the demo documents: how often each setting keeps the secret (question-aware).

    python tools/passkey_sweep.py 100,101,102 '{"ratio": 0.1}' '{"ratio": 0.1, "method": "snapkv"}'

Each JSON object is one setting (``ratio``, ``method`` and any JacapConfig option). For every seed,
``jacap_attn.prompts.demo_document(tokenizer, 1400, seed)`` gives a ~1.45k-token chat prompt whose
first question asks for a 7-digit magic number; the model (SmolLM2 by default, ``JACAP_MODEL`` to
change) answers greedily with 32 new tokens; a hit is the number appearing in the answer.
"""

import json
import os
import sys

import torch

import jacap_attn
from jacap_attn import prompts
from jacap_attn.models import load_model


def main(argv):
    seeds = [int(s) for s in argv[0].split(",")]
    settings = [json.loads(s) for s in argv[1:]]
    model, tok = load_model(os.environ.get("JACAP_MODEL", "smollm2"))
    docs = [prompts.demo_document(tok, context_tokens=1400, seed=s) for s in seeds]
    prompts = [torch.tensor([tok(d.prefix + d.suffixes[0], add_special_tokens=False)["input_ids"]]) for d in docs]
    for setting in settings:
        options = dict(setting)
        ratio, method = options.pop("ratio", 0.1), options.pop("method", "jacap")
        jacap_attn.patch(model, ratio=ratio, method=method, **options)
        hits = []
        for doc, ids in zip(docs, prompts):
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            hits.append(int(doc.answers[0] in tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)))
        print(json.dumps({"method": method, "ratio": ratio, "options": options, "seeds": seeds,
                          "found": sum(hits), "n": len(hits), "per_seed": hits}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Short chat prompts: does the compressed cache answer as the full cache does?

    python tools/short_prompts.py                       # 36 prompts, ratios 0.5 and 0.1, every rule
    python tools/short_prompts.py --n 8 --rules keep_special=false default min_tokens=128

Prompts: a fixed list of 16 questions in eight chat layouts (no system turn, a short system turn,
the geography system turn of the user report, a long system turn plus 1, 3, 6 or 12 earlier
questions and answers, and a user turn that pastes a paragraph of prose before its question),
built with the tokenizer's chat template: prompt ``i`` is layout ``i % 8`` with question
``(i // 8 + i) % 16``; the default 48 prompts have about 26 to 600 tokens (SmolLM2). For each prompt the model
(SmolLM2-135M-Instruct by default, ``--model``) answers greedily with ``--tokens`` new tokens over
the full cache and over each (rule, kept ratio); a prompt counts as a match when the answer's tokens
equal the full cache's exactly. The table also gives the mean kept fraction of the prompts' entries
(per prompt, kept entries per layer and KV head over its length).

Rules (``--rules``): comma-separated ``JacapConfig`` options applied on top of the defaults
(``default`` alone: the library's defaults), plus one measurement-only rule:

* ``keep_special=false``: the window alone in a short prompt (the library before the rule);
* ``default``: ``keep_special=True``: a row whose budget is no more than the observation window
  (``ceil(ratio * n) <= window``) also keeps the positions of the model's special ids
  (``generation_config`` bos / eos / pad; for SmolLM2 ``<|im_start|>`` and ``<|im_end|>``, i.e.
  every role marker of the chat template), on top of its budget;
* ``min_tokens=M``: a prompt of fewer than ``M`` tokens keeps everything;
* ``special-always`` (measurement only, not a library option): the special positions are kept in
  every prompt, short or not (``keep_special=False`` plus a wrapper around the selection).

Prints one table (matches out of the prompts, per rule and ratio, then per prompt-length band) and
the command that made it; ``eval/results/short_prompts_smollm2.md`` holds the published run.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys

import torch

import jacap_attn
from jacap_attn import selection
from jacap_attn.models import load_model

QUESTIONS = [
    "What is the largest ocean on Earth?",
    "What is the capital of Australia?",
    "Which river is the longest in Africa?",
    "How many continents are there?",
    "What is the highest mountain in the world?",
    "Which country has the largest population?",
    "What is the smallest country in the world?",
    "Which desert is the largest hot desert?",
    "What is the capital city of Canada?",
    "Which ocean lies between Africa and Australia?",
    "What language is spoken in Brazil?",
    "Which planet is closest to the Sun?",
    "What is the boiling point of water at sea level?",
    "Who wrote the play Romeo and Juliet?",
    "What gas do plants absorb from the air?",
    "How many days are there in a leap year?",
]
GEOGRAPHY = "You are a helpful assistant created to answer geography questions."
LONG_SYSTEM = ("You are a friendly and knowledgeable assistant. Answer every question accurately and "
               "concisely, in one or two sentences, using plain language that a high-school student can "
               "follow. If you are not sure, say so instead of guessing.")


HISTORY = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Which is the largest planet in the Solar System?", "Jupiter is the largest planet in the Solar System."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is the chemical symbol for gold?", "The chemical symbol for gold is Au, from the Latin word aurum."),
    ("Who painted the Mona Lisa?", "The Mona Lisa was painted by Leonardo da Vinci in the early sixteenth century."),
    ("What is the freezing point of water in Fahrenheit?", "Water freezes at 32 degrees Fahrenheit at sea level."),
    ("Why is the sky blue?", "Sunlight is scattered by the air's molecules, and blue light, with its short wavelength, "
                             "is scattered much more than red light, so the sky looks blue from every direction."),
    ("How do vaccines work?", "A vaccine shows the immune system a harmless piece or copy of a germ, so that it learns "
                              "to recognise it and can fight the real germ quickly later."),
    ("What causes the seasons?", "The Earth's axis is tilted, so over the year each hemisphere leans towards the Sun "
                                 "and then away from it, which changes the length of the day and the angle of sunlight."),
    ("Why do we have leap years?", "A year is about 365 and a quarter days long, so an extra day every four years keeps "
                                   "the calendar in step with the seasons."),
    ("How does a rainbow form?", "Sunlight enters raindrops, bends, reflects inside them and bends again on the way "
                                 "out, and each colour bends by a slightly different angle."),
    ("What is photosynthesis?", "Photosynthesis is how plants use sunlight, water and carbon dioxide to make sugar, "
                                "releasing oxygen as a by-product."),
]


def _pasted_text() -> str:
    """About 400 tokens of real prose (the library's offline haystack), pasted by a user before asking."""
    from jacap_attn.prose import haystack_paragraphs

    words, out = 0, []
    for paragraph in (p for doc in haystack_paragraphs() for p in doc):
        out.append(paragraph)
        words += len(paragraph.split())
        if words >= 300:
            break
    return "\n\n".join(out)


def layouts(question: str) -> list[list[dict]]:
    """The eight chat layouts of one question."""
    user = {"role": "user", "content": question}

    def history(turns):
        return [m for q, a in HISTORY[:turns] for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]

    long = {"role": "system", "content": LONG_SYSTEM}
    return [
        [user],
        [{"role": "system", "content": "You are a helpful assistant."}, user],
        [{"role": "system", "content": GEOGRAPHY}, user],
        [long, *history(1), user],
        [long, *history(3), user],
        [long, *history(6), user],
        [long, *history(12), user],
        [{"role": "user", "content": "Here is some text I was reading:\n\n" + _pasted_text() + "\n\n" + question}],
    ]


def build_prompts(tok, n: int) -> list[torch.Tensor]:
    """``n`` prompts: layout ``i % 8`` with question ``(i // 8 + i) % 16`` (distinct pairs up to 128)."""
    out = []
    for i in range(n):
        messages = layouts(QUESTIONS[(i // 8 + i) % len(QUESTIONS)])[i % 8]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(torch.tensor([tok(text, add_special_tokens=False)["input_ids"]]))
    return out


@contextlib.contextmanager
def keep_ids(ids: set[int]):
    """Measurement-only rule: keep the prompt positions holding ``ids`` in every compressed layer and
    head, on top of each head's budget (their scores become +inf like the window's)."""
    original = selection.gather

    def gather(cache, plans):
        prompt = cache.prompt_ids
        protect = torch.isin(prompt, torch.tensor(sorted(ids), device=prompt.device)) & cache.prefill.key_valid
        for plan in plans:
            if not plan.compressed:
                continue
            mask = protect.to(plan.scores.device) & plan.key_valid
            n = mask.shape[-1]
            outside = mask & (torch.arange(n, device=mask.device) < n - min(plan.window, n))
            plan.scores = plan.scores.masked_fill(mask[:, None, :], float("inf"))
            extra = outside.sum(-1)[:, None].to(plan.head_budgets.device)
            plan.head_budgets = torch.minimum(plan.head_budgets + extra, plan.key_valid.sum(-1)[:, None].to(extra.device))
        return original(cache, plans)

    selection.gather = gather
    try:
        yield
    finally:
        selection.gather = original


def parse_rule(rule: str) -> tuple[bool, dict]:
    """``(special_always, options)`` of a rule."""
    always, options = False, {}
    for part in filter(None, rule.split(",")):
        if part == "special-always":
            always, options["keep_special"] = True, False
        elif "=" in part:
            name, value = part.split("=", 1)
            options[name] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
        elif part != "default":
            raise SystemExit(f"unknown rule part {part!r} in {rule!r}")
    return always, options


def greedy(model, ids, tokens: int) -> tuple[list[int], float]:
    """The greedy answer's token ids and the kept fraction of the prompt's entries (1.0 unpatched)."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                         pad_token_id=model.generation_config.pad_token_id, return_dict_in_generate=True)
    kept = getattr(out, "cache", None) or out.past_key_values
    kept = getattr(kept, "prompt_kept", None)
    fraction = 1.0 if not kept else float(torch.stack([k.double() for k in kept]).mean()) / ids.shape[1]
    return out.sequences[0, ids.shape[1]:].tolist(), fraction


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--n", type=int, default=48, help="prompts (at most 128 distinct)")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.25, 0.1])
    p.add_argument("--rules", nargs="+", default=["keep_special=false", "keep_special=false,min_tokens=64",
                                                  "keep_special=false,min_tokens=128", "special-always", "default",
                                                  "min_tokens=64", "min_tokens=128"])
    p.add_argument("--method", default="jacap")
    p.add_argument("--tokens", type=int, default=20, help="new tokens compared")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python tools/short_prompts.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    model, tok = load_model(args.model)
    special_ids = set(selection.special_token_ids(model))
    prompts = build_prompts(tok, args.n)
    lengths = [ids.shape[1] for ids in prompts]
    print(f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens (median {sorted(lengths)[len(lengths) // 2]}); "
          f"special ids {sorted(special_ids)} = {tok.convert_ids_to_tokens(sorted(special_ids))}", file=sys.stderr)
    with torch.no_grad():
        full = [greedy(model, ids, args.tokens)[0] for ids in prompts]
    match: dict[tuple[str, float], list[bool]] = {}
    kept: dict[tuple[str, float], float] = {}
    for rule in args.rules:
        always, options = parse_rule(rule)
        for ratio in args.ratios:
            jacap_attn.patch(model, ratio=ratio, method=args.method, **options)
            with (keep_ids(special_ids) if always else contextlib.nullcontext()), torch.no_grad():
                got = [greedy(model, ids, args.tokens) for ids in prompts]
            jacap_attn.unpatch(model)
            match[rule, ratio] = [g == f for (g, _), f in zip(got, full)]
            kept[rule, ratio] = sum(k for _, k in got) / len(got)
            print(f"  {rule} @ {ratio}: {sum(match[rule, ratio])}/{len(prompts)}", file=sys.stderr, flush=True)
    bands = [(0, 32), (33, 64), (65, 128), (129, 256), (257, 384), (385, 512), (513, 10**9)]
    bands = [(lo, hi) for lo, hi in bands if any(lo <= n <= hi for n in lengths)]
    band_names = [f"{lo}-{hi}" if hi < 10**9 else f">{lo - 1}" for lo, hi in bands]
    print(f"Exact match of the first {args.tokens} greedy tokens with the full cache ({args.model}, method "
          f"{args.method}, {len(prompts)} chat prompts of {min(lengths)}-{max(lengths)} tokens)\n")
    print("| rule | kept ratio | mean kept fraction | matches | " + " | ".join(f"{b} tok (n={sum(lo <= n <= hi for n in lengths)})"
                                                    for b, (lo, hi) in zip(band_names, bands)) + " |")
    print("|---|---|---|---|" + "---|" * len(bands))
    for (rule, ratio), ok in match.items():
        cells = [f"{sum(o for o, n in zip(ok, lengths) if lo <= n <= hi)}" for lo, hi in bands]
        print(f"| {rule} | {ratio} | {kept[rule, ratio]:.2f} | {sum(ok)}/{len(ok)} | " + " | ".join(cells) + " |")
    print(f"\ncommand: {command}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

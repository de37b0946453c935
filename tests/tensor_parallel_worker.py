"""One ``torchrun`` launch of many tensor-parallel cases (tests/test_tensor_parallel.py runs it).

    torchrun --nproc_per_node 2 tests/tensor_parallel_worker.py MODELS_DIR OUT_JSON

``MODELS_DIR`` holds tiny random-weight models saved with their tokenizer, one folder per family
(:func:`save_family`). Every rank loads each with ``tp_plan="auto"`` (gloo on the CPU) and runs each
case: the kept positions per (layer, KV head) and the greedy tokens. Rank 0 gathers every rank's heads
(rank order is head order) and also runs each case on a single-process copy of the same weights. Then
the saved files: a document compressed and saved by the tensor-parallel model is loaded by the
single-process one (and the other way round). Rank 0 writes everything to ``OUT_JSON``; the test
compares, with exact equality. Nothing is compared here.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import jacap_attn
import jacap_attn.config
from jacap_attn.storage.identity import weights_fingerprint

NEW_TOKENS = 6
PROMPT = 160
BOS, EOS, PAD = 1, 2, 0
FAMILIES = ("llama", "qwen3", "gemma3_text", "mistral", "qwen2", "phi3")
MATRIX = ("llama", "qwen3", "gemma3_text")  # ratio 0.25 / 0.1 x budget global / uniform


def save_family(family: str, folder: Path, config_overrides: dict) -> None:
    """A tiny model of ``family`` (tests/conftest.py's configs) and a tokenizer whose vocabulary has
    word starts (``▁``) and continuations, so word spans are not trivial, saved to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from conftest import tiny_model

    model = tiny_model(family, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, **config_overrides)
    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS}
    vocab.update({(f"\u2581w{i}" if i % 3 else f"p{i}"): i for i in range(3, model.config.vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                     pad_token="<pad>", unk_token="<pad>")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def prompt(batch: int = 1, length: int = PROMPT, seed: int = 1):
    """``(ids, attention_mask)``: random ids with a BOS first and an EOS inside (special tokens); with
    ``batch`` 2 the second row left-padded by 9."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 96, (batch, length), generator=gen)
    ids[:, 0], ids[:, length // 3] = BOS, EOS
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :9], mask[1, :9] = PAD, 0
        ids[1, 9] = BOS
    return ids, mask


def cases(family: str) -> dict:
    """Name -> (patch options, what to run) for ``family``: an observation window of 8, so that even
    ``ratio=0.1`` of the 160-token prompt ranks tokens beyond it (``*/special``: the default window of
    32, above that budget, so the prompt's special tokens are kept on top)."""
    out = {}
    ratios = ((0.25, "global"), (0.25, "uniform"), (0.1, "global"), (0.1, "uniform")) if family in MATRIX \
        else ((0.25, "global"),)
    for ratio, budget in ratios:
        out[f"{family}/jacap/{ratio}/{budget}"] = (dict(ratio=ratio, budget=budget), "generate")
    if family in MATRIX:
        out[f"{family}/jacap/special"] = (dict(ratio=0.1, window=32), "generate")
    if family == "llama":
        for method in ("snapkv", "adakv", "pyramidkv", "h2o", "tova", "keydiff", "knorm", "capkv", "streaming_llm",
                       "random", "full"):
            out[f"llama/{method}"] = (dict(ratio=0.25, method=method), "generate")
        out["llama/adakv/global"] = (dict(ratio=0.25, method="adakv", budget="global"), "generate")
        out["llama/jacap/capacity"] = (dict(ratio=0.25, budget="capacity"), "generate")
        out["llama/jacap/normalized"] = (dict(ratio=0.1, global_score="normalized"), "generate")
        out["llama/jacap/output"] = (dict(ratio=0.1, global_score="output"), "generate")
        out["llama/jacap/chunked-output"] = (dict(ratio=0.1, chunk_size=48, global_score="output"), "generate")
        out["llama/kvzip/repeat"] = (dict(ratio=0.25, method="kvzip", queries="repeat"), "generate")
        out["llama/jacap/batch"] = (dict(ratio=0.25), "batch")
        out["llama/jacap/chunked"] = (dict(ratio=0.25, chunk_size=48), "generate")
        out["llama/jacap/chunked-carry"] = (dict(ratio=0.1, chunk_size=48, chunk_scores="carry"), "generate")
        out["llama/jacap/reselect"] = (dict(ratio=0.25), "reselect")
        out["llama/jacap/lookup"] = (dict(ratio=0.1, lookup=3, lookup_len=8, lookup_free=0), "lookup")
        out["llama/jacap/reselect-global"] = (dict(ratio=0.1, reselect_budget="global"), "reselect")
        out["llama/adakv/reselect"] = (dict(ratio=0.25, method="adakv"), "reselect")
    if family == "gemma3_text":
        out["gemma3_text/jacap/chunked"] = (dict(ratio=0.25, chunk_size=48), "generate")
        out["gemma3_text/jacap/reselect"] = (dict(ratio=0.1), "reselect")
    return out


def kept(cache) -> list:
    """Per layer, row and KV head: the kept logical positions, sorted."""
    out = []
    for layer in cache.layers:
        _, _, positions, valid = layer.export()
        out.append([[sorted(positions[r, h][valid[r, h]].tolist()) for h in range(valid.shape[1])]
                    for r in range(valid.shape[0])])
    return out


def run_case(model, kind: str) -> dict:
    """Kept sets and greedy tokens of one case on a patched ``model``."""
    if kind == "reselect":  # a document stored whole, reselected by a question
        ids, _ = prompt()
        doc = jacap_attn.Document.compress(model, ids)
        question = prompt(length=12, seed=7)[0][:, 1:]
        cache = doc.fresh_cache()
        with torch.no_grad():
            model(input_ids=question, cache=cache, use_cache=True)
        return {"kept": kept(cache), "tokens": doc.generate(question, max_new_tokens=NEW_TOKENS,
                                                            do_sample=False).tolist()}
    ids, mask = prompt(2 if kind == "batch" else 1)
    if kind == "lookup":  # the window's last 6 tokens repeated earlier: prompt lookup keeps them (D12)
        ids[:, 50:56] = ids[:, -6:]
    cache = jacap_attn.compress(model, ids, mask)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD)
    return {"kept": kept(cache), "tokens": out[:, ids.shape[1]:].tolist()}


def every_head(group, value: dict) -> dict:
    """Every rank's kept sets, joined per (layer, row) in rank order (the model's head order) when the
    ranks hold different heads; else rank 0's, with whether every rank kept the same. Every rank's
    tokens."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, value)
    if group.split:
        joined = [[sum((p["kept"][i][r] for p in parts), []) for r in range(len(layer))]
                  for i, layer in enumerate(parts[0]["kept"])]
        value = dict(value, kept=joined)
    else:
        value = dict(value, kept=parts[0]["kept"], same_on_ranks=all(p["kept"] == parts[0]["kept"] for p in parts))
    value["tokens_per_rank"] = [p["tokens"] for p in parts]
    return value


def main(models: Path, out_path: Path) -> None:
    warnings.simplefilter("ignore")
    jacap_attn.config.DEFAULT_MIN_TOKENS = 0  # tiny prompts are compressed, as in the suite
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results = {"cases": {}, "fingerprint": {}, "files": {}, "seconds": {}, "world_size": int(os.environ["WORLD_SIZE"])}
    start = time.perf_counter()
    for family in FAMILIES:
        folder = models / family
        tp = transformers.AutoModelForCausalLM.from_pretrained(
            folder, distributed_config=transformers.DistributedConfig(tp_plan="auto"), dtype=torch.float32).eval()
        sp = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval() if rank == 0 else None
        results["fingerprint"][family] = {"tp": weights_fingerprint(tp), "sp": sp and weights_fingerprint(sp)}
        for name, (options, kind) in cases(family).items():
            options = {"window": 8, **options} if options.get("method") != "full" else options
            jacap_attn.patch(tp, **options)
            results["cases"][name] = {"tp": every_head(tp._jacap_state.heads, run_case(tp, kind)),
                                      "heads": repr(tp._jacap_state.heads)}
            jacap_attn.unpatch(tp)
            if rank == 0:
                jacap_attn.patch(sp, **options)
                results["cases"][name]["sp"] = run_case(sp, kind)
                jacap_attn.unpatch(sp)
        if family in MATRIX:
            results["files"][family] = files(tp, sp, models / f"{family}.tp.safetensors", rank)
        dist.barrier()
    results["disagreements"] = disagreements(models / "llama", models, rank)
    lm_start = time.perf_counter()
    scores = [None] * dist.get_world_size()
    dist.all_gather_object(scores, lm_eval_scores(models / "llama", tp=True))
    results["lm_eval"] = {"tp_per_rank": scores, "sp": lm_eval_scores(models / "llama", tp=False) if rank == 0 else None}
    results["seconds"]["lm_eval"] = time.perf_counter() - lm_start
    results["seconds"]["all"] = time.perf_counter() - start
    if rank == 0:
        out_path.write_text(json.dumps(results))


def disagreements(folder: Path, out_dir: Path, rank: int) -> list:
    """Every rank's errors (or ``None``) when the ranks patch with other settings, load other files, or one rank
    cannot read the file: each is a ``ValueError`` (or the reader's ``OSError``) on every rank, not a hang or a
    silent divergence."""
    tp = transformers.AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=transformers.DistributedConfig(tp_plan="auto"), dtype=torch.float32).eval()
    files = [out_dir / f"disagree_{ratio}.safetensors" for ratio in (0.25, 0.1)]
    for ratio, path in zip((0.25, 0.1), files):  # two documents, saved by the ranks together
        jacap_attn.patch(tp, ratio=ratio, window=8)
        jacap_attn.Document.compress(tp, prompt()[0]).save(path)
        jacap_attn.unpatch(tp)
    path = files[0]
    out = {}
    for name, action in (
            ("patch", lambda: jacap_attn.patch(tp, ratio=0.25 if rank == 0 else 0.1, window=8)),
            ("repatch", lambda: (jacap_attn.patch(tp, ratio=0.25), jacap_attn.patch(tp, ratio=0.25, window=4 + 4 * rank))),
            ("other files", lambda: jacap_attn.load_cache(files[rank % 2], tp)),
            ("missing file", lambda: jacap_attn.load_cache(path if rank == 0 else path.with_suffix(".none"), tp))):
        try:
            action()
            out[name] = None
        except (ValueError, OSError) as err:
            out[name] = f"{type(err).__name__}: {err}"
        out[name + " patched"] = jacap_attn.is_patched(tp) and tp._jacap_state.config.ratio
        jacap_attn.unpatch(tp)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, out)
    return every


def files(tp, sp, path: Path, rank: int) -> dict:
    """A document compressed and saved (8-bit and exact) by the tensor-parallel model, loaded by the
    single-process one; one saved by the single-process model, loaded by the tensor-parallel one."""
    ids, _ = prompt()
    question = prompt(length=12, seed=7)[0][:, 1:]
    out = {}
    for quantize in ("int8", None):
        jacap_attn.patch(tp, ratio=0.25, window=8)
        doc = jacap_attn.Document.compress(tp, ids)
        size = doc.save(path, quantize=quantize)
        tp_answer = doc.generate(question, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
        jacap_attn.unpatch(tp)
        entry = {"size_per_rank": [None] * dist.get_world_size(), "tp_answer": tp_answer}
        dist.all_gather_object(entry["size_per_rank"], size)
        if rank == 0:
            loaded = jacap_attn.Document.load(path, sp)  # patched here with the file's settings
            entry["sp_loaded_answer"] = loaded.generate(question, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
            entry["sp_loaded_kept"] = kept(loaded.cache)
            jacap_attn.unpatch(sp)
            jacap_attn.patch(sp, ratio=0.25, window=8)
            own = jacap_attn.Document.compress(sp, ids)
            entry["sp_answer"] = own.generate(question, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
            entry["sp_kept"] = kept(own.cache)
            own.save(path.with_suffix(".sp.safetensors"), quantize=quantize)
            entry["sp_size"] = path.with_suffix(".sp.safetensors").stat().st_size
            jacap_attn.unpatch(sp)
        dist.barrier()
        loaded = jacap_attn.Document.load(path.with_suffix(".sp.safetensors"), tp)  # every rank its own heads
        entry["tp_loaded_answer"] = loaded.generate(question, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()
        entry["tp_loaded_kept"] = every_head(tp._jacap_state.heads, {"kept": kept(loaded.cache), "tokens": None})["kept"]
        jacap_attn.unpatch(tp)
        out[str(quantize)] = entry
    return out


def lm_eval_scores(folder: Path, *, tp: bool):
    """``hf-jacap``'s loglikelihoods (lm-eval's Python API) of a few requests on the model in ``folder``,
    loaded with ``tp_plan="auto"`` or in this process alone; ``None`` without lm-eval."""
    try:
        from lm_eval.api.instance import Instance

        from jacap_attn.integrations.lm_eval import JacapLM
    except ImportError:
        return None
    words = [f"\u2581w{i}" if i % 3 else f"p{i}" for i in range(3, 96)]

    def text(n, seed):
        return " ".join(words[i] for i in torch.randint(len(words), (n,), generator=torch.Generator().manual_seed(seed)))

    pairs = [(text(90, 1), " " + text(k, 10 + k)) for k in (1, 1, 4)] + [(text(40, 2), " " + text(3, 3)),
                                                                         ("p3", " " + text(2, 4))]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    placement = {"tp_plan": "auto"} if tp else {"device": "cpu"}
    lm = JacapLM(pretrained=str(folder), batch_size=1, max_length=128, ratio=0.25, window=4, **placement)
    return [list(answer) for answer in lm.loglikelihood(requests, disable_tqdm=True)]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(Path(sys.argv[1]), Path(sys.argv[2]))

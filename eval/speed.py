"""`python -m eval.speed` (`make bench`): prefill and selection cost, eager and compiled decode, memory, bandwidth floor.

One run measures, side by side on one model and one prompt shape (context x batch):

* prefill time of the stock model, of the patched model without selection (``method="full"``) and
  with Jacap selection; the selection overhead is their difference as a fraction of the stock prefill;
* the time of one decode step (median over ``--steps`` after ``--warmup``) for each configuration
  in :data:`CONFIGS`: stock transformers (``DynamicCache`` eager, ``StaticCache`` compiled), the
  full-size ``JacapCache`` and the compressed one (eager and compiled, ``fullgraph=True``; the
  padded layout under SDPA), and the compressed one under ``backend="xformers"`` (the ragged
  layout, one more prefill; rows ``skipped`` with the reason where xformers cannot run: no CUDA, or
  not installed), each with the KV bytes its attention reads from the cache (``cache_bytes_read``);
* KV bytes (full, physical, kept), peak device memory (CUDA only), and the bytes/bandwidth floor of a
  decode step, ``(weight bytes + KV bytes read) / bandwidth``, with the bandwidth measured in the
  same run by a large device-to-device copy (bytes read + written / time);
* for every budget policy of ``--budgets`` (one more prefill each), the compressed cache's
  physical bytes (its ``[b, h, capacity, d]`` buffers) beside its kept bytes, split into the room
  left for the new tokens, the padding of KV heads to their layer's largest head, and the capacity
  bucket's rounding, and the bytes one decode step reads from it (:func:`cache_memory`): under SDPA
  the padded layout reads every slot (the padding too), under xformers the ragged layout reads the
  held entries. On a pretrained model the prompt is prose (the demo
  document, :func:`jacap_attn.prompts.demo_document`): adaptive budgets depend on what the
  attention sees, which random ids do not show;
* the routes of question-agnostic compression (README "Documents: compress once, ask later"), on the
  first shape only and on the same prompt (unless ``--no-routes``; :func:`route_costs`): route A,
  ``compress`` with the observation window (``queries="window"``) vs with the repeat pass
  (``queries="repeat"``, the model's repeat instruction; a fixed list of ids on random weights),
  beside the stock prefill of the same ids and the repeat pass alone; route B, a 32-token question's
  forward over a copy of a stored cache: compressed at the kept ratio (a plain forward), stored whole
  (``ratio=1``) and reselected to the kept ratio by the question (``reselect``), and stored whole
  without reselection; the stored caches' bytes (buffers, kept) and what each holds after the
  question. Each call: min seconds over ``--prefill-repeats`` (wall clock, and the process's CPU
  time, which other jobs on a shared machine inflate less) and its peak device memory (CUDA; ``None``
  on the CPU, where only the process's RSS high-water mark before and after the section is recorded).
  The report states the repeat pass's cost in stock prefills and whether it is within
  :data:`REPEAT_PASS_TARGET` (issue 24 item 4); ``--only-routes`` measures this section alone.

As in gpt-fast, only the decode step is compiled (one small function, at this entry point), and
warm-up steps keep compile time out of the measured steps. The model is either a real one
(``--model``, loaded by :func:`jacap_attn.models.load_model`) or random weights from a config
(``--config``: a preset of :data:`PRESETS` or a ``config.json`` path). Weights do not change speed.

    python -m eval.speed                       # CPU default: SmolLM2 at 1900 tokens (= make bench)
    python -m eval.speed --config llama-8b --shape 8192x1 --shape 32768x8 --device cuda
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import gc
import inspect
import json
import os
import pathlib
import platform
import resource
import statistics
import sys
import time

import torch

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"

# decode configurations: name -> (cache kind, compiled)
CONFIGS = {
    "stock-eager": ("dynamic", False),
    "stock-static-compiled": ("static", True),
    "jacap-full-eager": ("full", False),
    "jacap-full-compiled": ("full", True),
    "jacap-eager": ("jacap", False),
    "jacap-compiled": ("jacap", True),
    # The ragged layout read by xformers' fmha (backend="xformers"; CUDA with xformers only, else
    # recorded as skipped with the reason). The other jacap rows run backend="sdpa", the padded layout.
    "jacap-xformers-eager": ("xformers", False),
    "jacap-xformers-compiled": ("xformers", True),
}
BASELINE = "stock-eager"
# Budget policies whose memory is reported (--budgets): a policy name, or global:<global_score>.
BUDGET_POLICIES = "uniform,pyramid,capacity,global,global:normalized"

_LLAMA = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=131072)
PRESETS = {
    # Llama-3.1-8B shape (RESEARCH.md's H200 measurements).
    "llama-8b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    # Llama-3.2-1B shape.
    "llama-1b": dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    # SmolLM2-135M shape (the embedded default model), random weights.
    "smollm2-shape": dict(_LLAMA, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                          max_position_embeddings=8192),
    "tiny": dict(_LLAMA, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=False,
                 max_position_embeddings=8192),
}
FALLBACK_PRESET = "smollm2-shape"


# ----------------------------------------------------------------------------------------------- CLI
def _positive(text: str) -> int:
    """An argparse type: a positive integer (``--context 0`` once ran the default context without a word)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _shape(text: str) -> str:
    """An argparse type: ``CONTEXTxBATCH`` (or ``CONTEXT``), both positive integers; the text as given."""
    context, _, batch = text.lower().partition("x")
    try:
        _positive(context), _positive(batch or "1")
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"--shape takes CONTEXTxBATCH (e.g. 8192x1), got {text!r}: {err}") from None
    return text


def add_speed_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the options of ``python -m eval.speed`` to ``parser`` (returned)."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--model", help="model name (jacap_attn.models) or folder; default: smollm2, else "
                                     f"random weights of --config {FALLBACK_PRESET}")
    src.add_argument("--config", help=f"random-weight model: {', '.join(PRESETS)} or a config.json path")
    parser.add_argument("--context", type=_positive, help="prompt tokens (default: the model's context, at most 2048, "
                                                      "less room for the new tokens: 1900)")
    parser.add_argument("--batch", type=int, default=1, help="prompts per batch (default 1)")
    parser.add_argument("--shape", action="append", metavar="CONTEXTxBATCH", type=_shape,
                        help="prompt shape, repeatable (e.g. --shape 8192x1 --shape 32768x8); overrides --context/--batch")
    parser.add_argument("--ratio", type=float, default=0.1, help="kept fraction (default 0.1)")
    parser.add_argument("--method", default="jacap", help="compression method (default jacap)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and cache dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda if available)")
    parser.add_argument("--steps", type=int, help="measured decode steps per configuration (default 16 CPU, 32 CUDA)")
    parser.add_argument("--warmup", type=int, help="unmeasured decode steps first (default 3 CPU, 5 CUDA)")
    parser.add_argument("--prefill-repeats", type=int, default=2, help="timed prefills per variant, min taken (default 2)")
    parser.add_argument("--budgets", default=BUDGET_POLICIES,
                        help="budget policies whose KV bytes (buffers vs kept) are reported, comma-separated: a "
                             f"policy or global:<global_score> (default {BUDGET_POLICIES}); 'none' for none")
    parser.add_argument("--only-routes", action="store_true",
                        help="measure only the route costs (stock prefill, window and repeat-pass compress, the "
                             "pass alone, route B) on the first shape: no prefill, decode or budget rows")
    parser.add_argument("--no-routes", action="store_true",
                        help="skip the route costs (repeat pass vs window compress, question-time reselection; "
                             "first shape only: about five more prefills)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated decode configurations (default all: {','.join(CONFIGS)})")
    parser.add_argument("--compile-mode", default="auto",
                        help="torch.compile mode (auto: reduce-overhead on CUDA, default on CPU)")
    parser.add_argument("--out", help="JSON path (default eval/results/speed_<device>_<date>.json); '-' for none")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return parser


def speed_main(argv=None) -> int:
    """Entry point of ``python -m eval.speed`` (``make bench``): run, print the table,
    save the JSON. Returns 0."""
    parser = add_speed_arguments(argparse.ArgumentParser(prog="python -m eval.speed", description=__doc__.split("\n")[0]))
    args = parser.parse_args(argv)
    try:
        resolve_settings(args)
    except ValueError as error:
        parser.error(str(error))
    result = run_speed(args)
    print(format_table(result))
    out = args.out if args.out else default_out_path(result)
    if out != "-":
        path = pathlib.Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


def default_out_path(result: dict, tag: str | None = None) -> str:
    """``eval/results/speed_<tag>_<date>.json`` of this checkout, whatever the current directory."""
    tag = tag or ("cuda" if result["device"]["type"] == "cuda" else "cpu")
    return str(RESULTS_DIR / f"speed_{tag}_{datetime.date.today().isoformat()}.json")


# ------------------------------------------------------------------------------------------- running
def run_speed(args: argparse.Namespace, on_shape=None) -> dict:
    """Run the benchmark described by ``args`` (see :func:`add_speed_arguments`); return the results.

    ``on_shape(result)``, if given, is called with the results so far after each prompt shape (to
    save partial results of a long run)."""
    from tqdm.auto import tqdm

    device, dtype, steps, warmup, mode, configs = resolve_settings(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    model, source, max_context = load_bench_model(args, dtype, device)
    tokenizer = source.pop("tokenizer", None)
    policies = budget_policies(args.budgets)
    shapes = parse_shapes(args, max_context, warmup + steps)
    bandwidth = measure_bandwidth(device)
    routes, only_routes = not getattr(args, "no_routes", False), getattr(args, "only_routes", False)
    if only_routes:
        shapes = shapes[:1]
    plan = 1 if only_routes else sum(3 + len(configs) + len(policies) for _ in shapes) + int(routes)
    bar = tqdm(total=plan, desc="bench speed", unit="run", disable=args.no_progress)
    result = header(args, model, source, device, dtype, bandwidth,
                    settings={"ratio": args.ratio, "method": args.method, "steps": steps, "warmup": warmup,
                              "compile_mode": mode, "prefill_repeats": args.prefill_repeats, "configs": configs,
                              "budgets": [policy_name(p) for p in policies], "routes": routes,
                              "only_routes": only_routes,
                              "question_tokens": QUESTION_TOKENS if routes else None})
    result["device"]["load_average_1m_start"] = load_start
    with bar, torch.no_grad():
        for number, (context, batch) in enumerate(shapes):
            gen = torch.Generator().manual_seed(args.seed)
            ids = torch.randint(100, model.config.vocab_size - 100, (batch, context), generator=gen).to(device)
            memory_ids = memory_prompt(tokenizer, ids, source)
            bench = ShapeBench(model, ids, ratio=args.ratio, method=args.method, steps=steps, warmup=warmup,
                               mode=mode, repeats=args.prefill_repeats, bandwidth=bandwidth, bar=bar,
                               policies=policies, memory_ids=memory_ids,
                               routes=route_inputs(tokenizer, memory_ids, model.config.vocab_size, seed=args.seed)
                               if routes and number == 0 else None)
            try:
                result["shapes"].append(bench.run_routes() if only_routes else bench.run(configs))
            except Exception as error:  # noqa: BLE001 - e.g. out of memory: keep the other shapes
                message = f"{type(error).__name__}: {str(error)[:800]}"
                print(f"eval.speed: {context}x{batch} failed: {message}", file=sys.stderr)
                result["shapes"].append({"context": context, "batch": batch, "error": message})
            del bench
            release(device)
            result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            result["device"]["load_average_1m"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            if on_shape is not None:
                on_shape(result)
    return result


def header(args, model, source, device, dtype, bandwidth, settings) -> dict:
    """The run-level part of the results: where, what, versions, command line, bandwidth."""
    from jacap_attn.types import dtype_name

    weights, weights_read = model_bytes(model)
    timing = ("decode: median ms of the measured steps (CUDA events / perf_counter); "
              "prefill: min over repeats, after a short warm-up prefill")
    return {
        "benchmark": "speed",
        "command": command_line(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": device_info(device),
        "versions": versions(),
        "model": source,
        "weight_bytes": weights,
        "weight_bytes_read_per_step": weights_read,
        "dtype": dtype_name(dtype),
        "settings": dict(settings, timing=timing, threads=torch.get_num_threads()),
        "bandwidth_gbps": bandwidth / 1e9,
        "shapes": [],
    }


def command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith(("eval/speed.py", "eval\\speed.py")):
        argv[0:1] = ["python", "-m", "eval.speed"]
    return " ".join(argv)


def resolve_settings(args):
    """``(device, dtype, steps, warmup, compile mode, configs)`` with the device-dependent defaults."""
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    steps = args.steps or (32 if cuda else 16)
    warmup = max(1, args.warmup if args.warmup is not None else (5 if cuda else 3))
    mode = args.compile_mode if args.compile_mode != "auto" else ("reduce-overhead" if cuda else "default")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown --configs {unknown}; known: {', '.join(CONFIGS)}")
    from jacap_attn.config import JacapConfig
    JacapConfig.from_options(ratio=args.ratio, method=args.method)  # a bad --ratio/--method fails here
    budget_policies(args.budgets)  # a bad --budgets fails here
    if getattr(args, "only_routes", False) and getattr(args, "no_routes", False):
        raise ValueError("--only-routes and --no-routes exclude each other")
    return device, dtype, steps, warmup, mode, configs


def budget_policies(text: str | None) -> list[dict]:
    """``--budgets``: a list of ``patch`` options, e.g. ``[{"budget": "uniform"}, {"budget": "global",
    "global_score": "normalized"}]``. ``ValueError`` for an unknown policy or global score."""
    from jacap_attn.config import BUDGETS, GLOBAL_SCORES

    if not text or text.strip() == "none":
        return []
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        name, _, score = item.partition(":")
        if name not in BUDGETS or (score and (name != "global" or score not in GLOBAL_SCORES)):
            raise ValueError(f"unknown --budgets entry {item!r}: a policy ({', '.join(BUDGETS)}) or "
                             f"global:<{'|'.join(GLOBAL_SCORES)}>")
        out.append({"budget": name, **({"global_score": score} if score else {})})
    return out


def policy_name(options: dict) -> str:
    return options["budget"] + (f":{options['global_score']}" if "global_score" in options else "")


def parse_shapes(args, max_context: int | None, new_tokens: int) -> list[tuple[int, int]]:
    if args.shape:
        shapes = []
        for text in args.shape:
            context, _, batch = text.lower().partition("x")
            shapes.append((int(context), int(batch or 1)))
        return shapes
    if args.context:
        return [(args.context, args.batch)]
    # The longest prompt the model supports (at most 2048 tokens), leaving room for the new tokens.
    limit = min(max_context or 2048, 2048)
    return [(limit - max(148, new_tokens + 1), args.batch)]


def load_bench_model(args, dtype, device):
    """``(model, description, max_context)``: a named/folder model or random weights from a config."""
    if args.config is None:
        name = args.model or "smollm2"
        try:
            from jacap_attn.models import MODELS, load_model
            model, tokenizer = load_model(name, dtype=dtype, device=device, attn_implementation="sdpa")
            spec = MODELS.get(name)
            return model, {"kind": "pretrained", "name": name, "tokenizer": tokenizer}, getattr(spec, "max_context", None)
        except Exception as error:  # noqa: BLE001 - any failure falls back to random weights
            if args.model is not None:
                raise
            print(f"eval.speed: cannot load {name!r} ({type(error).__name__}: {error}); "
                  f"using random weights of --config {FALLBACK_PRESET}", file=sys.stderr)
            args.config = FALLBACK_PRESET
    model = random_model(args.config, dtype, device, seed=args.seed)
    return model, {"kind": "random", "config": args.config}, None


def memory_prompt(tokenizer, ids: torch.Tensor, source: dict) -> torch.Tensor:
    """The prompt of the budget-memory measurements: with a tokenizer (a pretrained model), rows of
    prose of the shape of ``ids`` (the start of a question-aware demo prompt of that many tokens, one
    seed per row: adaptive budgets follow what the attention sees), noted in ``source``; without one
    (random weights), ``ids`` itself."""
    if tokenizer is None:
        return ids
    from jacap_attn.prompts import demo_document

    batch, context = ids.shape
    rows = []
    for row in range(batch):
        prompt = demo_document(tokenizer, context_tokens=context, seed=row).prompt(0)
        tokens = tokenizer(prompt, add_special_tokens=False)["input_ids"][:context]
        if len(tokens) < context:
            return ids  # a tokenizer that packs the prose tighter than asked: fall back to the ids
        rows.append(tokens)
    source["memory_prompt"] = "prose (jacap_attn.prompts.demo_document, seeds 0..b-1)"
    return torch.tensor(rows, device=ids.device)


def random_model(config_name: str, dtype, device, *, seed: int = 0, layers: int | None = None):
    """A ``*ForCausalLM`` with random weights, built directly on ``device`` (no CPU init, no copy); ``layers``:
    only that many decoder layers of the config (default all)."""
    import transformers

    if config_name in PRESETS:
        fields = dict(PRESETS[config_name])
        config = transformers.LlamaConfig(**{k: v for k, v in fields.items() if k != "model_type"})
    else:
        config = transformers.AutoConfig.from_pretrained(pathlib.Path(config_name).expanduser())
    if layers is not None:
        config.num_hidden_layers = layers
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


# ------------------------------------------------------------------------------------ one prompt shape
class ShapeBench:
    """All measurements for one prompt ``ids [b, n]`` on ``model`` (unpatched on entry and exit)."""

    def __init__(self, model, ids, *, ratio, method, steps, warmup, mode, repeats, bandwidth, bar,
                 policies=(), memory_ids=None, routes=None):
        self.model, self.ids = model, ids
        self.route_inputs, self.routes = routes, None  # (repeat_ids, question ids) of route_inputs; results
        self.policies, self.memory_ids = list(policies), ids if memory_ids is None else memory_ids
        self.ratio, self.method = ratio, method
        self.steps, self.warmup, self.mode, self.repeats = steps, warmup, mode, max(1, repeats)
        self.bandwidth, self.bar = bandwidth, bar
        self.device = ids.device
        self.keyword = cache_keyword(model)
        self.batch, self.context = ids.shape
        # Room for the prompt and one decode run (each configuration starts from the prefill's state).
        self.max_length = self.context + warmup + steps + 1
        self.weight_read = model_bytes(model)[1]
        self.decode, self.prefill, self.kv, self.budget_memory = {}, {}, {}, {}

    def run(self, configs: list[str]) -> dict:
        import jacap_attn

        self._stage("prefill: stock")
        self._stock(configs)
        jacap_attn.patch(self.model, ratio=1.0, method="full", backend="sdpa")
        try:
            self._stage("prefill: jacap full")
            self._jacap("full", [c for c in configs if CONFIGS[c][0] == "full"])
            jacap_attn.patch(self.model, ratio=self.ratio, method=self.method, backend="sdpa")
            self._stage(f"prefill: {self.method}")
            self._jacap("jacap", [c for c in configs if CONFIGS[c][0] == "jacap"])
            self._xformers([c for c in configs if CONFIGS[c][0] == "xformers"])
            for options in self.policies:
                self._policy_memory(options)
        finally:
            jacap_attn.unpatch(self.model)
        if self.route_inputs is not None:
            self._routes()
        return self._summary()

    def run_routes(self) -> dict:
        """Only the route costs (``--only-routes``): ``{context, batch, routes}``."""
        self._routes()
        return {"context": self.context, "batch": self.batch, "routes": self.routes}

    def _routes(self):
        """The route costs (:func:`route_costs`) on the memory prompt; a failure is recorded."""
        repeat_ids, question = self.route_inputs
        self._free()
        try:
            self.routes = route_costs(self.model, self.memory_ids, question, ratio=self.ratio, method=self.method,
                                      repeat_ids=repeat_ids, repeats=self.repeats,
                                      progress=lambda text: self._stage(f"routes: {text}"))
        except Exception as error:  # noqa: BLE001 - e.g. out of memory, a method without queries="repeat"
            self.routes = {"error": f"{type(error).__name__}: {str(error)[:800]}"}
            print(f"eval.speed: routes failed: {self.routes['error']}", file=sys.stderr)
        finally:
            self._free()
            self.bar.update()

    def _policy_memory(self, options):
        """One prefill of the memory prompt under a budget policy: its cache's bytes (:func:`cache_memory`)."""
        import jacap_attn
        from jacap_attn.storage.cache import JacapCache

        name = policy_name(options)
        self._stage(f"memory: {name}")
        try:  # the padded layout, read by SDPA: what the bytes below are about
            jacap_attn.patch(self.model, ratio=self.ratio, method=self.method, backend="sdpa", **options)
            cache = JacapCache(self.model, max_length=self.max_length)
            self._forward(self.memory_ids, cache)
            self.budget_memory[name] = cache_memory(cache, self.max_length - self.context)
        except Exception as error:  # noqa: BLE001 - a refused policy (pyramidkv fixes its own), out of memory
            self.budget_memory[name] = {"error": f"{type(error).__name__}: {str(error)[:800]}"}
        finally:
            self._free()
            self.bar.update()

    # -- stages
    def _stock(self, configs):
        from transformers.cache_utils import DynamicCache

        cache, logits = self._timed_prefill("stock", lambda: DynamicCache(config=self.model.config))
        self.first_token = logits[:, -1:].argmax(-1)
        self.kv["full_bytes"] = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
        if "stock-eager" in configs:
            self._decode("stock-eager", cache)
            # Back to the prompt, with no second copy alive during the eager decode. A negative
            # count removes tokens in every transformers 5.x (a positive one is an error since 5.18).
            cache.crop(-(int(cache.get_seq_length()) - self.context))
        if "stock-static-compiled" in configs:
            static = static_copy(self.model, cache, self.max_length)
            del cache
            self._free()
            self._decode_each(["stock-static-compiled"], static)

    def _jacap(self, kind, configs):
        from jacap_attn.storage.cache import JacapCache

        name = {"full": "jacap-full", "jacap": "jacap", "xformers": "jacap-xformers"}[kind]
        cache, _ = self._timed_prefill(name, lambda: JacapCache(self.model, max_length=self.max_length))
        if kind == "jacap":  # one more prefill, timing the selection work itself
            with selection_timer(self.device) as spent:
                self._forward(self.ids, JacapCache(self.model, max_length=self.max_length))
            self.prefill[name]["selection_seconds"] = spent[0] if spent else None
            self.prefill[name]["scoring"] = scoring_times(self.model, self.ids, self._forward, self.device,
                                                          self.max_length)
        self.kv[f"{kind}_physical_bytes"] = cache.kv_bytes()
        self.kv[f"{kind}_kept_bytes"] = cache.kept_bytes()
        self.kv[f"{kind}_capacity"] = max(layer.capacity for layer in cache.layers)  # each layer sizes its own
        self.kv[f"{kind}_capacities"] = [layer.capacity for layer in cache.layers]
        cache.ensure_room(self.warmup + self.steps + 1)
        self._decode_each(configs, cache)

    def _xformers(self, configs):
        """The ``jacap-xformers-*`` rows: one more prefill under ``backend="xformers"`` (the ragged
        layout), then its decode; where xformers cannot run (no CUDA, not installed), each row is
        ``{"skipped": reason}``."""
        import jacap_attn
        from jacap_attn.storage.xformers_backend import unavailable_reason

        if not configs:
            return
        reason = unavailable_reason(self.device)
        if reason is not None:
            for name in configs:
                self.decode[name] = {"skipped": reason}
                self.bar.update()
            return
        try:  # its prefill failing (out of memory, a kernel refusing the inputs) fails these rows only
            jacap_attn.patch(self.model, ratio=self.ratio, method=self.method, backend="xformers")
            self._stage("prefill: xformers")
            self._jacap("xformers", configs)
        except Exception as error:  # noqa: BLE001 - recorded and reported
            for name in configs:
                self.decode.setdefault(name, {"error": f"{type(error).__name__}: {str(error)[:800]}"})
            print(f"eval.speed: xformers failed: {type(error).__name__}: {str(error)[:300]}", file=sys.stderr)
            self._free()

    def _decode_each(self, configs, cache):
        """Decode with each configuration from the same post-prefill state (a copy for all but the
        last), so that their tokens can be compared."""
        for i, name in enumerate(configs):
            self._decode(name, cache if i == len(configs) - 1 else copy.deepcopy(cache))
        del cache
        self._free()

    def _stage(self, text):
        self.bar.set_postfix_str(f"{self.context}x{self.batch} {text}")

    # -- prefill
    def _timed_prefill(self, name, make_cache):
        """Prefill ``self.ids`` into fresh caches ``repeats`` times (after a short warm-up prefill);
        keep the last cache. Records time (min) and peak memory."""
        warm = self.ids[:, -min(self.context, 256):]
        self._forward(warm, make_cache())
        record, (cache, logits) = _timed_calls(self.device, self.repeats,
                                               lambda cache: (cache, self._forward(self.ids, cache)), make_cache)
        self.prefill[name] = {key: record[key] for key in ("seconds", "all_seconds", "peak_bytes")}
        self.bar.update()
        return cache, logits

    def _forward(self, ids, cache):
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.keyword: cache})
        return out.logits

    # -- decode
    def _decode(self, name, cache):
        """Time one decode configuration; a failure (compile error, out of memory) is recorded in
        its row and the run goes on (one failing configuration must not cost a whole GPU run)."""
        self._stage(f"decode: {name}")
        kind, compiled = CONFIGS[name]
        step = make_step(self.model, self.keyword)
        try:
            if compiled:
                reset_compiler()
                step = torch.compile(step, fullgraph=True, dynamic=False, mode=self.mode)
            reset_peak(self.device)
            times, tokens, first_s = time_decode(step, cache, self.first_token, int(cache.get_seq_length()),
                                                 self.warmup, self.steps,
                                                 cudagraphs=compiled and self.mode == "reduce-overhead")
            read = cache.read_bytes() if hasattr(cache, "read_bytes") else None  # before the steps: the prompt's
            self.decode[name] = {"ms_per_step": statistics.median(times) * 1e3,
                                 "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3,
                                 "first_step_s": first_s, "compile_s": first_s if compiled else None,
                                 "peak_bytes": peak_bytes(self.device), "tokens": tokens,
                                 "kv_bytes_read": self._kv_read(kind), "cache_bytes_read": read}
        except Exception as error:  # noqa: BLE001 - recorded and reported
            self.decode[name] = {"error": f"{type(error).__name__}: {str(error)[:800]}"}
            print(f"eval.speed: {name} failed: {self.decode[name]['error']}", file=sys.stderr)
        finally:
            if compiled:
                reset_compiler()
            self.bar.update()

    def _kv_read(self, kind) -> int:
        """KV bytes a decode step must read, the floor's: the whole prompt for full caches, the kept
        entries for the compressed ones (docs/architecture.md#decode-floor). What the step's attention
        reads from the cache is ``cache_bytes_read`` (:meth:`JacapCache.read_bytes`: every slot of the
        padded layout under SDPA, the held entries under xformers)."""
        return self.kv.get("jacap_kept_bytes", 0) if kind in ("jacap", "xformers") else self.kv["full_bytes"]

    def _free(self):
        release(self.device)

    # -- summary
    def _summary(self) -> dict:
        stock = self.prefill["stock"]["seconds"]
        jacap = self.prefill["jacap"]["seconds"]
        full = self.prefill["jacap-full"]["seconds"]
        base = self.decode.get(BASELINE, {}).get("ms_per_step")
        for name, row in self.decode.items():
            if "error" in row or "skipped" in row:
                continue
            row["floor_ms"] = (self.weight_read + row["kv_bytes_read"]) / self.bandwidth * 1e3
            row["x_floor"] = row["ms_per_step"] / row["floor_ms"]
            row["speedup_vs_stock"] = base / row["ms_per_step"] if base else None
            reference = self.decode.get("jacap-eager" if CONFIGS[name][0] in ("jacap", "xformers") else BASELINE, {})
            row["tokens_match_reference"] = reference["tokens"] == row["tokens"] if "tokens" in reference else None
        selection = self.prefill["jacap"].get("selection_seconds")
        return {
            "context": self.context, "batch": self.batch, "max_length": self.max_length,
            "prefill": self.prefill,
            "selection_fraction": selection / stock if selection is not None else None,
            "selection_overhead": (jacap - stock) / stock,
            "selection_overhead_vs_full_patched": (jacap - full) / full,
            "kv": self.kv, "budget_memory": self.budget_memory, "decode": self.decode, "targets": targets(self),
            **({"routes": self.routes} if self.routes is not None else {}),
        }


def targets(bench: ShapeBench) -> dict:
    """The benchmark targets (README/issue), evaluated where they apply to this shape."""
    d = {name: row for name, row in bench.decode.items() if "ms_per_step" in row}
    out = {}
    stock = bench.prefill["stock"]["seconds"]
    selection = bench.prefill["jacap"].get("selection_seconds")
    if selection is None:
        selection = bench.prefill["jacap"]["seconds"] - stock
    # Measured directly (scoring + finalize time), not as a difference of two noisy prefill times.
    out["selection_le_5pct_of_prefill_at_8k"] = (
        selection / stock <= 0.05 if bench.context >= 8192 else "n/a (context < 8192)")
    if "jacap-compiled" in d:
        floor = (bench.weight_read + d["jacap-compiled"]["kv_bytes_read"]) / bench.bandwidth * 1e3
        out["compiled_compressed_x_floor"] = d["jacap-compiled"]["ms_per_step"] / floor
        out["compiled_compressed_within_2x_floor"] = out["compiled_compressed_x_floor"] <= 2.0
        for full in ("jacap-full-compiled", "stock-static-compiled"):
            if full in d:
                ratio = d[full]["ms_per_step"] / d["jacap-compiled"]["ms_per_step"]
                out[f"speedup_compiled_compressed_vs_{full}"] = ratio
                out[f"compiled_compressed_faster_than_{full}"] = ratio > 1.0
    return out


# ---------------------------------------------------------------------------------------------- routes
# The question of route B: this text's first QUESTION_TOKENS token ids (random ids on random weights).
QUESTION = ("Question: according to the document above, which city was chosen as the meeting place, who chaired "
            "the committee that approved the final plan, in which year did the work begin, and what did it cost "
            "in the end? Answer in one short sentence.")
QUESTION_TOKENS = 32
RANDOM_REPEAT_IDS = 12  # length of the fixed repeat instruction of a random-weight model (no tokenizer)
REPEAT_PASS_TARGET = 2.0  # the repeat pass's cost in stock prefills at 1,900 tokens on the CPU (issue 24 item 4)
# A reselected question's forward against the same question's over the whole stored document without
# rescoring (issue 33; replaces issue 26's 1.5x against a cache stored at the ratio).
RESELECT_TARGET = 1.25


def route_inputs(tokenizer, ids: torch.Tensor, vocab_size: int, *, seed: int = 0) -> tuple[list[int], torch.Tensor]:
    """``(repeat_ids, question [b, QUESTION_TOKENS])`` of :func:`route_costs` for the prompt ``ids [b, n]``:
    with a tokenizer, :func:`jacap_attn.prompts.repeat_instruction_ids` and the first
    :data:`QUESTION_TOKENS` ids of :data:`QUESTION`; without one, fixed random ids (``seed``)."""
    b = ids.shape[0]
    if tokenizer is not None:
        from jacap_attn.prompts import repeat_instruction_ids

        question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"][:QUESTION_TOKENS]
        return repeat_instruction_ids(tokenizer), torch.tensor([question] * b, device=ids.device)
    gen = torch.Generator().manual_seed(seed + 14)
    low, high = min(3, vocab_size - 1), vocab_size
    repeat_ids = torch.randint(low, high, (RANDOM_REPEAT_IDS,), generator=gen).tolist()
    question = torch.randint(low, high, (1, QUESTION_TOKENS), generator=gen).expand(b, -1)
    return repeat_ids, question.to(ids.device)


@contextlib.contextmanager
def repeat_pass_timer(device):
    """Time every repeat pass (:meth:`jacap_attn.routes.repeat.RepeatRoute.run_pass`) run while the
    block runs; yields ``(wall seconds, CPU seconds)``, two lists with one entry per pass (empty if
    that method moved)."""
    from jacap_attn.routes.repeat import RepeatRoute

    spent, cpu, original = [], [], RepeatRoute.__dict__.get("run_pass")
    if not callable(original):
        yield spent, cpu
        return

    @functools.wraps(original)
    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            cpu.append(time.process_time() - start)

    RepeatRoute.run_pass = synced_timing(timed, device, spent.append)
    try:
        yield spent, cpu
    finally:
        RepeatRoute.run_pass = original


def _timed_calls(device, repeats: int, call, prepare=None) -> tuple[dict, object]:
    """``call(prepare())`` ``repeats`` times (the previous result dropped first); returns ``({seconds
    (min), all_seconds, cpu_seconds (min of the process's CPU time), all_cpu_seconds, peak_bytes,
    peak_increase_bytes}, the last result)``. The peak is
    ``torch.cuda.max_memory_allocated`` during the call (its increase over what was allocated when it
    started); ``None`` off CUDA."""
    records, results = _alternated_calls(device, repeats, {"call": (call, prepare)})
    return records["call"], results["call"]


def _alternated_calls(device, repeats: int, calls: dict) -> tuple[dict, dict]:
    """Each of ``calls`` (``{name: (call, prepare)}``) timed as :func:`_timed_calls` times one, the calls
    taking turns ``repeats`` times (``a b a b ...``), so that a slower stretch of a shared machine falls on
    all of them alike: ``({name: record}, {name: last result})``."""
    cuda = device.type == "cuda"
    records = {name: {"all_seconds": [], "all_cpu_seconds": [], "peaks": [], "increases": []} for name in calls}
    results = dict.fromkeys(calls)
    for _ in range(max(1, repeats)):
        for name, (call, prepare) in calls.items():
            results[name] = None
            argument = prepare() if prepare is not None else None
            gc.collect()
            sync(device)
            reset_peak(device)
            start_bytes = torch.cuda.memory_allocated(device) if cuda else None
            start, start_cpu = time.perf_counter(), time.process_time()
            results[name] = call(argument)
            sync(device)
            record = records[name]
            record["all_seconds"].append(time.perf_counter() - start)
            record["all_cpu_seconds"].append(time.process_time() - start_cpu)
            record["peaks"].append(peak_bytes(device))
            record["increases"].append(record["peaks"][-1] - start_bytes if cuda else None)
    out = {}
    for name, record in records.items():
        peaks, increases = record.pop("peaks"), record.pop("increases")
        out[name] = {"seconds": min(record["all_seconds"]), "all_seconds": record["all_seconds"],
                     "cpu_seconds": min(record["all_cpu_seconds"]), "all_cpu_seconds": record["all_cpu_seconds"],
                     "peak_bytes": max(peaks) if cuda else None,
                     "peak_increase_bytes": max(increases) if cuda else None}
    return out, results


def _held(cache) -> dict:
    """What ``cache`` holds: buffers (physical: ``compress`` leaves ``reserve`` free slots after the
    prompt) and kept bytes, the most entries a KV head holds per layer, the layers' capacities."""
    return {"physical_bytes": cache.kv_bytes(), "kept_bytes": cache.kept_bytes(),
            "max_held_per_head": [int(layer.kept_counts().max()) for layer in cache.layers],
            "capacities": [layer.capacity for layer in cache.layers]}


LOOKAHEAD = 16  # the lookahead row's written tokens (docs/method.md#d11-lookahead-queries)


def route_costs(model, ids: torch.Tensor, question: torch.Tensor, *, ratio: float, method: str = "jacap",
                repeat_ids=(), repeats: int = 1, progress=None) -> dict:
    """The cost of the two question-agnostic routes on ``model`` (unpatched on entry and exit) and
    the prompt ``ids [b, n]``, every call timed by :func:`_timed_calls` (min over ``repeats``, after a
    short warm-up call of the same kind for the compressions):

    ``route_a``: ``stock_prefill`` (the unpatched model, ``DynamicCache``), ``window``
    (``jacap_attn.compress`` under ``patch(ratio, method, lookahead=0)``), ``lookahead`` (the same with
    ``lookahead=LOOKAHEAD``, and ``lookahead_over_window``), ``repeat`` (the same with
    ``queries="repeat", repeat_ids=repeat_ids``; ``repeat_pass_seconds``: the pass alone, min over
    the timed calls, each in ``repeat_pass_all_seconds``; ``repeat_pass_cpu_seconds`` its CPU time)
    and their ratios, ``repeat_pass_over_stock_prefill`` in wall seconds and ``_cpu`` in CPU seconds,
    ``repeat_pass_within_target``: the wall ratio at most :data:`REPEAT_PASS_TARGET`. ``route_b``: the forward
    of ``question [b, q]`` (``logits_to_keep=1``, as ``generate``'s first step) over a copy of a
    stored cache (the copy made before the clock starts): ``stored_at_ratio`` the window route's
    cache (no reselection), ``stored_whole_reselect`` a cache compressed under ``patch(ratio=1,
    reselect=ratio)`` (its ``compress`` timed as ``compress_whole``) and reselected by the question,
    ``stored_whole`` the same cache with ``reselect`` off (these two timed taking turns, :func:`_alternated_calls`,
    so that their ratio compares the same stretch of a shared machine); for each, the stored cache's bytes (``stored``) and what it holds after the
    question (``after_question``; :func:`_held`). ``rss_high_water_mb``: the process's ``ru_maxrss``
    before and after (a high-water mark of the whole process, not this section's own use)."""
    import dataclasses

    import jacap_attn
    from transformers.cache_utils import DynamicCache

    device = ids.device
    b, n = ids.shape
    question = question.to(device).expand(b, -1) if question.shape[0] == 1 else question.to(device)
    keyword = cache_keyword(model)
    warm = ids[:, -min(n, 256):]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def stage(text):
        if progress is not None:
            progress(text)

    def forward(input_ids, cache):
        return model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{keyword: cache})

    def compress_timed(**options):
        jacap_attn.patch(model, ratio=options.pop("ratio", ratio), method=method, **options)
        jacap_attn.compress(model, warm)
        with repeat_pass_timer(device) as (passes, cpu):  # the timed calls' passes (not the warm-up's)
            record, cache = _timed_calls(device, repeats, lambda _: jacap_attn.compress(model, ids))
        if passes:
            record["repeat_pass_seconds"], record["repeat_pass_all_seconds"] = min(passes), passes
            record["repeat_pass_cpu_seconds"], record["repeat_pass_all_cpu_seconds"] = min(cpu), cpu
        return record, cache

    def copier(stored, config):
        def prepare():
            cache = copy.deepcopy(stored)
            if config:
                cache.config = dataclasses.replace(cache.config, **config)
            return cache
        return prepare

    def ask(cache):
        return forward(question, cache), cache

    def question_timed(stored, **config):
        return questions_alternated(stored, {"question": config})["question"]

    def questions_alternated(stored, variants: dict) -> dict:
        """The question over copies of ``stored`` under each of ``variants`` (``{name: config changes}``),
        taking turns (:func:`_alternated_calls`)."""
        records, results = _alternated_calls(
            device, repeats, {name: (ask, copier(stored, config)) for name, config in variants.items()})
        for name, record in records.items():
            record["after_question"] = _held(results[name][1])
        return records

    out = {"context": n, "batch": b, "ratio": ratio, "method": method, "question_tokens": question.shape[1],
           "repeat_instruction_tokens": len(repeat_ids)}
    try:
        with torch.no_grad():
            stage("stock prefill")
            forward(warm, DynamicCache(config=model.config))
            stock, _ = _timed_calls(device, repeats, lambda _: forward(ids, DynamicCache(config=model.config)))
            stage("compress, window")
            window, at_ratio = compress_timed(lookahead=0)
            stage(f"compress, lookahead {LOOKAHEAD}")
            ahead, _ = compress_timed(lookahead=LOOKAHEAD)
            stage("compress, repeat pass")
            repeat, _ = compress_timed(queries="repeat", repeat_ids=list(repeat_ids))
            passed = repeat.setdefault("repeat_pass_seconds", None)
            passed_cpu = repeat.setdefault("repeat_pass_cpu_seconds", None)
            pass_ratio = passed / stock["seconds"] if passed else None
            out["route_a"] = {
                "stock_prefill": stock, "window": window, "repeat": repeat, "lookahead": ahead,
                "lookahead_tokens": LOOKAHEAD, "lookahead_over_window": ahead["seconds"] / window["seconds"],
                "repeat_over_window": repeat["seconds"] / window["seconds"],
                "window_over_stock_prefill": window["seconds"] / stock["seconds"],
                "repeat_over_stock_prefill": repeat["seconds"] / stock["seconds"],
                "repeat_pass_over_stock_prefill": pass_ratio,
                "repeat_pass_over_stock_prefill_cpu": (passed_cpu / stock["cpu_seconds"]
                                                       if passed_cpu and stock["cpu_seconds"] > 0 else None),
                "repeat_pass_target": REPEAT_PASS_TARGET,
                "repeat_pass_within_target": pass_ratio <= REPEAT_PASS_TARGET if pass_ratio else None}
            stage("question, stored at ratio")
            jacap_attn.patch(model, ratio=ratio, method=method)
            plain = question_timed(at_ratio)
            plain["stored"] = _held(at_ratio)
            del at_ratio
            stage("compress, stored whole")
            compress_whole, whole = compress_timed(ratio=1.0, reselect=ratio)
            stage("question, stored whole: reselected and not rescored, taking turns")
            pair = questions_alternated(whole, {"reselected": {}, "unselected": {"reselect": None}})
            reselected, unselected = pair["reselected"], pair["unselected"]
            reselected["stored"] = unselected["stored"] = _held(whole)
            stage(f"question, stored whole, lookahead {LOOKAHEAD}")
            ahead_q = question_timed(whole, lookahead=LOOKAHEAD)
            ahead_q["stored"] = reselected["stored"]
            del whole
            out["route_b"] = {
                "compress_whole": compress_whole, "stored_at_ratio": plain,
                "stored_whole_reselect": reselected, "stored_whole": unselected,
                "stored_whole_reselect_lookahead": ahead_q,
                "reselect_over_plain": reselected["seconds"] / plain["seconds"],
                "reselect_lookahead_over_reselect": ahead_q["seconds"] / reselected["seconds"],
                "whole_over_plain": unselected["seconds"] / plain["seconds"],
                "reselect_over_whole": reselected["seconds"] / unselected["seconds"],
                "reselect_over_whole_cpu": (reselected["cpu_seconds"] / unselected["cpu_seconds"]
                                            if unselected.get("cpu_seconds") else None),
                "reselect_target": RESELECT_TARGET,
                "whole_timing": "alternated",  # stored_whole_reselect and stored_whole took turns (2026-12-07)
                "stored_kept_whole_over_at_ratio": reselected["stored"]["kept_bytes"] / plain["stored"]["kept_bytes"],
                "stored_physical_whole_over_at_ratio": (reselected["stored"]["physical_bytes"]
                                                        / plain["stored"]["physical_bytes"])}
    finally:
        jacap_attn.unpatch(model)
    out["rss_high_water_mb"] = {"before": rss_before,
                                "after": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    return out


# --------------------------------------------------------------------------------------------- helpers
def synced_timing(function, device, record):
    """``function`` wrapped to pass the seconds of each call (the device synchronised before and
    after it) to ``record``."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        sync(device)
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            sync(device)
            record(time.perf_counter() - start)
    return wrapper


@contextlib.contextmanager
def selection_timer(device):
    """Time the selection work of a Jacap prefill: every ``score_layer`` call (window attention,
    scores; :func:`jacap_attn.selection.scorer.score_layer`) and ``finalize_prefill`` (budgets, top-k, gather;
    :func:`jacap_attn.selection.finalize_prefill`), synchronising around each on CUDA.
    Yields a one-element list holding the seconds spent (empty if those functions moved)."""
    from jacap_attn import selection
    from jacap_attn.selection import scorer

    spent, swapped = [0.0], []

    def add(seconds):
        spent[0] += seconds

    for module, name in ((scorer, "score_layer"), (selection, "finalize_prefill")):
        if callable(getattr(module, name, None)):
            swapped.append((module, name, getattr(module, name)))
            setattr(module, name, synced_timing(getattr(module, name), device, add))
    try:
        yield spent if len(swapped) == 2 else []
    finally:
        for module, name, original in swapped:
            setattr(module, name, original)


def scoring_times(model, ids, forward, device, max_length) -> dict:
    """Eager vs compiled scoring, side by side on the same inputs: during one more prefill, each
    scored layer's :class:`~jacap_attn.methods.PrefillInputs` go through the method's
    ``score_parts`` eagerly and through :func:`jacap_attn.selection.scorer.compiled_scorer` (what
    ``compile=True`` runs on CUDA); seconds summed over layers, the first compiled call (tracing and
    code generation) reported apart as ``compile_seconds``."""

    from jacap_attn.selection import scorer
    from jacap_attn.storage.cache import JacapCache
    from jacap_attn.routes.window import PrefillRoute, window_queries

    cfg = model._jacap_state.config
    method = cfg.method
    out = {"method": method.name, "compilable": method.compilable, "layers": 0, "eager_seconds": 0.0,
           "compiled_seconds": 0.0 if method.compilable else None, "compile_seconds": None}
    compiled = scorer.compiled_scorer(method) if method.compilable else None

    def timed(fn, inputs):
        sync(device)
        start = time.perf_counter()
        fn(inputs)
        sync(device)
        return time.perf_counter() - start

    def observe(index, query, keys, values, scaling):
        if not PrefillRoute.scored(cache, index):
            return
        key_valid, budget = scorer.layer_inputs(cfg, cache.layers, index, cache.prefill.key_valid, keys.device)
        inputs, _ = scorer.prefill_inputs(cfg, index, window_queries(query, keys.shape[1], cfg.window), keys, values,
                                          scaling, key_valid, budget)
        out["layers"] += 1
        if compiled is not None:
            if out["compile_seconds"] is None:
                out["compile_seconds"] = timed(compiled, inputs)
            out["compiled_seconds"] += timed(compiled, inputs)
        out["eager_seconds"] += timed(method.score_parts, inputs)

    cache = JacapCache(model, max_length=max_length, on_prefill=observe)
    with torch.no_grad():
        forward(ids, cache)
    if out["compiled_seconds"]:
        out["compiled_speedup"] = out["eager_seconds"] / out["compiled_seconds"]
    return out


def cache_memory(cache, room: int) -> dict:
    """Where the bytes of a compressed cache's ``[b, h, capacity, d]`` buffers go (all layers):

    ``kept_bytes`` the prompt entries kept; ``physical_bytes`` the buffers; ``room_bytes`` the slots
    left for the ``room`` tokens to come (used by decoding); ``head_padding_bytes`` the slots of KV
    heads below their layer's largest kept count (per-head budgets: Ada-KV, the ``global`` policy)
    and rows with fewer real tokens; ``rounding_bytes`` the rest (the capacity bucket's rounding).
    ``unused_fraction = (head padding + rounding) / physical``; ``capacities`` per layer.

    What a decode step reads from the cache: ``read_bytes`` (:meth:`JacapCache.read_bytes`, this
    cache's layout and backend: for the padded layout under SDPA every slot of every layer, the
    head padding, the rounding and the free room included, i.e. the buffers) and ``read_over_kept``;
    ``xformers_read_bytes``, what the ``ragged`` layout under ``backend="xformers"`` reads from the
    same entries (:meth:`jacap_attn.storage.ragged.RaggedLayer.read_bytes`: each head's held entries in a
    full-attention layer, every slot of a sliding-window one), and ``xformers_read_over_kept``."""
    kept = padded = room_bytes = xformers_read = 0
    for layer in cache.layers:
        slot, (b, h) = layer.slot_bytes(), layer.valid.shape[:2]
        kept += int(layer.valid.sum()) * slot
        padded += b * h * int(layer.write_pos) * slot
        room_bytes += b * h * min(room, layer.capacity - int(layer.write_pos)) * slot
        xformers_read += layer.buffer_bytes() if layer.is_sliding else layer.kept_bytes()
    physical, read = cache.kv_bytes(), cache.read_bytes()
    return {"kept_bytes": kept, "physical_bytes": physical, "room_bytes": room_bytes,
            "head_padding_bytes": padded - kept, "rounding_bytes": physical - padded - room_bytes,
            "unused_fraction": (physical - kept - room_bytes) / physical,
            "read_bytes": read, "read_over_kept": read / kept,
            "xformers_read_bytes": xformers_read, "xformers_read_over_kept": xformers_read / kept,
            "capacities": [layer.capacity for layer in cache.layers]}


def cache_keyword(model) -> str:
    """The forward keyword of the cache: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    state = getattr(model, "_jacap_state", None)
    if state is not None:
        return state.cache_keyword
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def make_step(model, keyword: str):
    """The decode step that gets compiled: ``tok [b, 1]``, ``pos [b, 1]`` -> next greedy ``[b, 1]``."""
    def decode_one_token(tok, pos, cache):
        logits = model(input_ids=tok, position_ids=pos, use_cache=True, **{keyword: cache}).logits
        return logits[:, -1:].argmax(-1)
    return decode_one_token


def time_decode(step, cache, first_token, start_pos: int, warmup: int, steps: int, *, cudagraphs: bool):
    """Run ``warmup + steps`` greedy steps; return (per-step seconds of the measured steps, the first
    8 tokens of row 0, seconds of the first step, which includes compilation)."""
    device = first_token.device
    b = first_token.shape[0]
    positions = torch.arange(start_pos, start_pos + warmup + steps, device=device)[None].expand(b, -1)
    cuda = device.type == "cuda"
    tok, tokens, times, events, first_s = first_token, [], [], [], 0.0
    for i in range(warmup + steps):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        timed_on_host = i == 0 or not cuda  # the first step (compilation) is timed on the host
        if timed_on_host:
            sync(device)
            start = time.perf_counter()
        else:
            events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            events[-1][0].record()
        tok = step(tok, positions[:, i:i + 1].contiguous(), cache).clone()
        if timed_on_host:
            sync(device)
            elapsed = time.perf_counter() - start
            if i == 0:
                first_s = elapsed
            if i >= warmup:
                times.append(elapsed)
        else:
            events[-1][1].record()
        tokens.append(tok)
    sync(device)
    if cuda:  # events[j] timed step j + 1
        times = [s.elapsed_time(e) / 1e3 for s, e in events[warmup - 1:]]
    return times, torch.cat(tokens, -1)[0, :8].tolist(), first_s


def static_copy(model, dynamic, max_length: int):
    """A stock ``StaticCache`` of ``max_length`` slots holding the same prompt K/V as ``dynamic``
    (filled through the layers' own ``update``: the state a StaticCache prefill would leave)."""
    from transformers.cache_utils import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kwargs = {"max_cache_len": max_length}
    if "config" in params:
        kwargs["config"] = model.config
    static = StaticCache(**kwargs)
    for src, dst in zip(dynamic.layers, static.layers):
        dst.update(src.keys, src.values)
    return static


def measure_bandwidth(device: torch.device) -> float:
    """Device memory bandwidth in bytes/s: a large copy, bytes read + written / time (best of 5)."""
    nbytes = (2 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / best


def model_bytes(model) -> tuple[int, int]:
    """``(all weight bytes, weight bytes a decode step reads)``: an untied input embedding table is
    read one row per token, so it is left out of the second number."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed
    return total, total - (0 if tied else embed.numel() * embed.element_size())


def release(device):
    """Free what is no longer referenced (and, on CUDA, return cached blocks)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device):
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_compiler():
    """Drop compiled graphs (and CUDA graph pools) so every configuration compiles on its own."""
    torch._dynamo.reset()
    if torch.cuda.is_available():
        with contextlib.suppress(ImportError):  # older torch: no CUDA graph trees to reset
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees
            reset_cudagraph_trees()


def device_info(device: torch.device) -> dict:
    info = {"type": device.type, "threads": torch.get_num_threads(), "platform": platform.platform(),
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
        info["memory_gb"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    else:
        info["name"] = cpu_name()
    return info


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``, else ``"cpu"``."""
    with contextlib.suppress(OSError):  # no /proc/cpuinfo (not Linux)
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def versions() -> dict:
    import transformers

    import jacap_attn

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "jacap_attn": jacap_attn.__version__}
    with contextlib.suppress(ImportError):  # triton is optional (CUDA builds only)
        import triton
        out["triton"] = triton.__version__
    with contextlib.suppress(ImportError):  # xformers is optional (the [cuda] extra; not imported here)
        import importlib.metadata
        out["xformers"] = importlib.metadata.version("xformers")
    return out


# --------------------------------------------------------------------------------------------- report
def format_table(result: dict) -> str:
    """A compact text table per shape: rows = decode configurations."""
    dev = result["device"]
    where = f"{dev['name']}, {dev['threads']} threads, load {dev.get('load_average_1m_start') or 0:.1f}" \
        if dev["type"] == "cpu" else dev["name"]
    model = result["model"].get("name") or result["model"].get("config")
    lines = [f"{model} ({result['model']['kind']}) | {result['dtype']} | {where} | bandwidth "
             f"{result['bandwidth_gbps']:.1f} GB/s | weights read/step {result['weight_bytes_read_per_step'] / 1e9:.3f} GB"]
    load, cores = dev.get("load_average_1m_start"), os.cpu_count() or 1
    if dev["type"] == "cpu" and load is not None and load > 0.75 * cores:
        lines.append(f"WARNING: the machine was busy (load {load:.1f} on {cores} cores): CPU timings are unreliable")
    for shape in result["shapes"]:
        if "error" in shape:
            lines += ["", f"context {shape['context']} x batch {shape['batch']}: error: {shape['error'][:200]}"]
            continue
        if "prefill" not in shape:  # --only-routes
            lines += ["", f"context {shape['context']} x batch {shape['batch']}: route costs only"]
            lines += format_routes(shape.get("routes"), result)
            continue
        p = shape["prefill"]
        lines.append("")
        fraction = shape.get("selection_fraction")
        lines.append(f"context {shape['context']} x batch {shape['batch']}: prefill stock {p['stock']['seconds']:.3f} s, "
                     f"jacap-full {p['jacap-full']['seconds']:.3f} s, jacap {p['jacap']['seconds']:.3f} s "
                     f"({100 * shape['selection_overhead']:+.1f}%); selection itself "
                     + (f"{p['jacap']['selection_seconds']:.3f} s = {100 * fraction:.1f}% of stock prefill"
                        if fraction is not None else "n/a"))
        sc = p["jacap"].get("scoring")
        if sc:
            compiled = (f"compiled {sc['compiled_seconds']:.3f} s ({sc['compiled_speedup']:.2f}x; first call "
                        f"{sc['compile_seconds']:.1f} s)" if sc.get("compiled_speedup") else "compiled n/a (eager only)")
            lines.append(f"scoring ({sc['method']}, {sc['layers']} layers): eager {sc['eager_seconds']:.3f} s, {compiled}")
        kv = shape["kv"]
        lines.append(f"KV: full {kv['full_bytes'] / 1e6:.1f} MB, kept {kv.get('jacap_kept_bytes', 0) / 1e6:.1f} MB "
                     f"(physical {kv.get('jacap_physical_bytes', 0) / 1e6:.1f} MB, capacity "
                     f"{_span(kv.get('jacap_capacities') or [kv.get('jacap_capacity')])})")
        lines += format_budget_memory(shape.get("budget_memory") or {}, result)
        lines += format_routes(shape.get("routes"), result)
        lines.append(f"{'config':<24}{'ms/step':>10}{'floor ms':>10}{'x floor':>9}{'speed-up':>10}{'compile s':>11}"
                     f"{'peak GB':>9}{'read MB':>9}")
        for name, row in shape["decode"].items():
            if "error" in row or "skipped" in row:
                what = "error" if "error" in row else "skipped"
                lines.append(f"{name:<24}{what}: {row[what][:120]}")
                continue
            peak = f"{row['peak_bytes'] / 2**30:.1f}" if row["peak_bytes"] is not None else "n/a"
            comp = f"{row['compile_s']:.1f}" if row["compile_s"] is not None else "-"
            speed = f"{row['speedup_vs_stock']:.2f}x" if row["speedup_vs_stock"] else "-"
            read = f"{row['cache_bytes_read'] / 1e6:.1f}" if row.get("cache_bytes_read") is not None else "-"
            lines.append(f"{name:<24}{row['ms_per_step']:>10.2f}{row['floor_ms']:>10.2f}{row['x_floor']:>9.2f}"
                         f"{speed:>10}{comp:>11}{peak:>9}{read:>9}")
        t = shape["targets"]
        for key in ("speedup_compiled_compressed_vs_jacap-full-compiled",
                    "speedup_compiled_compressed_vs_stock-static-compiled"):
            if key in t:
                lines.append(f"{key.replace('_', ' ')}: {t[key]:.2f}x")
    return "\n".join(lines)


def format_budget_memory(memory: dict, result: dict) -> list[str]:
    """The per-policy KV bytes rows of :func:`format_table` (MB; ``unused`` = head padding + rounding)."""
    if not memory:
        return []
    prompt = result["model"].get("memory_prompt", "the benchmark's ids")
    lines = [f"KV bytes by budget policy ({result['settings']['method']}, kept ratio {result['settings']['ratio']}, "
             f"prompt: {prompt}), MB; read/step = what one decode step's attention reads from the cache:",
             "  the padded layout under SDPA reads every slot of every layer (its padding: heads below their "
             "layer's largest, the bucket's rounding, the free room); ragged+xformers reads the held entries only",
             f"  {'policy':<20}{'kept':>8}{'buffers':>9}{'room':>8}{'heads pad':>10}{'rounding':>9}{'unused':>8}"
             f"{'read/step':>11}{'read/kept':>10}{'xf read':>9}{'xf/kept':>8}  capacities"]
    for name, row in memory.items():
        if "error" in row:
            lines.append(f"  {name:<20}{row['error'][:100]}")
            continue
        lines.append(f"  {name:<20}{row['kept_bytes'] / 1e6:>8.2f}{row['physical_bytes'] / 1e6:>9.2f}"
                     f"{row['room_bytes'] / 1e6:>8.2f}{row['head_padding_bytes'] / 1e6:>10.2f}"
                     f"{row['rounding_bytes'] / 1e6:>9.2f}{100 * row['unused_fraction']:>7.1f}%"
                     f"{row['read_bytes'] / 1e6:>11.2f}{row['read_over_kept']:>9.2f}x"
                     f"{row['xformers_read_bytes'] / 1e6:>9.2f}{row['xformers_read_over_kept']:>7.2f}x"
                     f"  {_span(row['capacities'])}")
    return lines


def format_routes(routes: dict | None, result: dict) -> list[str]:
    """The route-cost rows of :func:`format_table` (:func:`route_costs`): seconds, peak device memory
    (GB, CUDA only), bytes of the stored caches (MB) and what they hold after the question."""
    if not routes:
        return []
    if "error" in routes:
        return [f"Routes: error: {routes['error'][:200]}"]
    prompt = result["model"].get("memory_prompt", "the benchmark's ids")
    a, b = routes["route_a"], routes["route_b"]

    def gb(row):
        return f"{row['peak_bytes'] / 2**30:.2f}" if row.get("peak_bytes") is not None else "n/a"

    passed = a["repeat"].get("repeat_pass_seconds")
    lines = [f"Routes ({routes['method']}, kept ratio {routes['ratio']}, prompt: {prompt}, {routes['context']} x "
             f"{routes['batch']}; repeat instruction {routes['repeat_instruction_tokens']} tokens, question "
             f"{routes['question_tokens']} tokens; min of {len(a['window']['all_seconds'])}):",
             f"  A  {'call':<34}{'s':>9}{'x window':>10}{'x stock':>9}{'peak GB':>9}",
             f"     {'stock prefill':<34}{a['stock_prefill']['seconds']:>9.3f}{'':>10}{1:>9.2f}"
             f"{gb(a['stock_prefill']):>9}",
             f"     {'compress, window':<34}{a['window']['seconds']:>9.3f}{1:>10.2f}"
             f"{a['window_over_stock_prefill']:>9.2f}{gb(a['window']):>9}",
             f"     {'compress, repeat pass':<34}{a['repeat']['seconds']:>9.3f}{a['repeat_over_window']:>10.2f}"
             f"{a['repeat_over_stock_prefill']:>9.2f}{gb(a['repeat']):>9}"]
    if "lookahead" in a:  # results from before 2026-12-04 have no lookahead row
        label = f"compress, window + lookahead {a['lookahead_tokens']}"
        lines.append(f"     {label:<34}{a['lookahead']['seconds']:>9.3f}{a['lookahead_over_window']:>10.2f}"
                     f"{a['lookahead']['seconds'] / a['stock_prefill']['seconds']:>9.2f}{gb(a['lookahead']):>9}")
    if passed is not None:
        lines.append(f"     {'  of which the repeat pass':<34}{passed:>9.3f}{'':>10}"
                     f"{a['repeat_pass_over_stock_prefill']:>9.2f}")
    lines.append(f"     {'compress, stored whole (ratio 1)':<34}{b['compress_whole']['seconds']:>9.3f}"
                 f"{b['compress_whole']['seconds'] / a['window']['seconds']:>10.2f}"
                 f"{b['compress_whole']['seconds'] / a['stock_prefill']['seconds']:>9.2f}{gb(b['compress_whole']):>9}")
    lines.append(f"  B  {'question forward over':<34}{'s':>9}{'x plain':>10}{'peak GB':>9}"
                 f"{'stored MB buf/kept':>22}{'after: MB buf/kept':>20}{'max/head':>10}")
    for key, label, ratio in (("stored_at_ratio", "stored at ratio (plain)", 1.0),
                              ("stored_whole_reselect", "stored whole, reselect", b["reselect_over_plain"]),
                              ("stored_whole_reselect_lookahead", f"stored whole, reselect + lookahead {LOOKAHEAD}",
                               b.get("stored_whole_reselect_lookahead", {}).get("seconds", 0) / b["stored_at_ratio"]["seconds"]),
                              ("stored_whole", "stored whole, no reselect", b["whole_over_plain"])):
        if key not in b:  # results from before the fourth session of 2026-12-04 have no lookahead question
            continue
        row = b[key]
        stored, after = row["stored"], row["after_question"]
        lines.append(f"     {label:<34}{row['seconds']:>9.4f}{ratio:>10.2f}{gb(row):>9}"
                     f"{stored['physical_bytes'] / 1e6:>13.2f} / {stored['kept_bytes'] / 1e6:<6.2f}"
                     f"{after['physical_bytes'] / 1e6:>11.2f} / {after['kept_bytes'] / 1e6:<6.2f}"
                     f"{max(after['max_held_per_head']):>10}")
    if passed is not None:
        lines.append(repeat_pass_verdict(a))
    if "reselect_over_whole" in b:
        ratio, cpu = b["reselect_over_whole"], b.get("reselect_over_whole_cpu")
        cpu_text = f" ({cpu:.2f}x in CPU seconds)" if cpu is not None else ""
        verdict = "within" if ratio <= b["reselect_target"] else "NOT within"
        turns = " (timed taking turns)" if b.get("whole_timing") == "alternated" else ""
        lines.append(f"  reselected question / the same over the whole document, not rescored{turns}: "
                     f"{ratio:.2f}x{cpu_text}: {verdict} {b['reselect_target']:.2f}x")
    return lines


def repeat_pass_verdict(a: dict) -> str:
    """The line of :func:`format_routes` on the repeat pass's cost: ``repeat pass / stock prefill`` in
    wall and CPU seconds, and whether it is within :data:`REPEAT_PASS_TARGET` (``a``: ``route_a``)."""
    target = a.get("repeat_pass_target", REPEAT_PASS_TARGET)
    ratio, cpu = a["repeat_pass_over_stock_prefill"], a.get("repeat_pass_over_stock_prefill_cpu")
    cpu_text = f" ({cpu:.2f}x in CPU seconds)" if cpu is not None else ""
    verdict = "within" if ratio <= target else "NOT within"
    return f"  repeat pass / stock prefill: {ratio:.2f}x{cpu_text}: {verdict} {target:.1f}x"


def _span(values) -> str:
    """``"a"`` or ``"a-b"``: the range of per-layer capacities."""
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    return str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"


if __name__ == "__main__":
    sys.exit(speed_main())

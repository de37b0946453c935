"""`hf-jacap`: lm-evaluation-harness's ``hf`` model with jacap_attn KV-cache compression (docs/architecture.md#lm-evaluation-harness).

    lm_eval --model hf-jacap --model_args pretrained=<folder>,ratio=0.1,method=jacap,window=32 ...

Every ``hf`` model argument works as before; the fields of :class:`~jacap_attn.config.JacapConfig`
(``ratio``, ``method``, ``window``, ``budget``, ``ridge``, ``beta``, ``pooling``, ``kernel``,
``sinks``, ...) are taken out of the model arguments, cast to their types, validated, and applied with
:func:`jacap_attn.patch` (with lm-eval's tokenizer, for word spans) once the model is loaded; a model
passed in as an object (``JacapLM(pretrained=model)``) is patched only while a request runs and left
as it was found afterwards.

How requests are answered:

* ``loglikelihood``: the context (left-truncated exactly as ``hf`` does) is prefilled *without its
  last token* with compression (:func:`jacap_attn.compress`); then the last context token and the
  continuation except its last token are fed over the compressed cache, at their logical positions,
  and the continuation tokens are scored. So the first continuation token is predicted from the
  compressed cache too. A context is compressed once for all its continuations (each continuation
  runs on its own copy of the cache); two contexts never share a cache. A one-token context has
  nothing to compress and runs as a plain forward.
* ``generate_until``: inherited from ``hf``: left-padded batches go to the patched ``generate``, whose
  prefill compresses each sample's prompt on its own.
* ``loglikelihood_rolling``: inherited; it scores lm-eval's disjoint windows through the
  loglikelihood path above. Most windows have a one-token context: without ``chunk_size`` such a
  window is one exact forward (compression comes after a prefill), so a text within ``max_length``
  scores as under ``hf``, and a warning says so; under ``chunk_size`` the window is prefilled in
  chunks, each chunk's tokens scored over the compressed cache of the chunks before it (perplexity
  under compression, as StreamingLLM measures it).

``reselect`` is refused: no request asks a question over a stored cache (a context and its
continuation are scored in one pass, a prompt is generated from in one prefill), so it would change nothing.

With ``ratio=1`` (or ``method=full``) scores equal those of ``hf`` to float tolerance.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import numbers

import torch
import torch.nn.functional as F
from tqdm import tqdm

try:
    from lm_eval.api.registry import model_registry, register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as err:  # pragma: no cover - depends on the installed extras
    raise ImportError("the hf-jacap model needs lm-evaluation-harness: pip install 'jacap-attn[eval]'") from err

from ..version import __version__
from ..methods.base import registered_fields
from ..config import JacapConfig
from ..model_state import length_dependent_rope, rope_for_length
from ..patching import compress, patch, unpatch
from . import LM_EVAL_MODEL_NAME

logger = logging.getLogger(__name__)

_DEFAULT = object()  # an option given as None: the method's default
_RATIO, _METHOD = 0.1, "jacap"  # hf-jacap's defaults, also for ratio=None and method=None


def option_types() -> dict[str, str]:
    """Options accepted in ``--model_args`` with their annotations (``"float"``, ``"int"``, ...): the
    fields of :class:`JacapConfig` and of every registered method (user methods included)."""
    fields = [*dataclasses.fields(JacapConfig), *registered_fields()]
    types = {f.name: f.type if isinstance(f.type, str) else f.type.__name__ for f in fields}
    types["method"] = "str"
    return types


def pop_jacap_options(kwargs: dict) -> dict:
    """Remove the Jacap options from ``kwargs`` (lm-eval model arguments) and return them cast to
    their field types.

    ``backend=default|causal|seq2seq`` is ``hf``'s own argument and stays in ``kwargs`` (:data:`HF_BACKENDS`).
    lm-eval parses ``key=value`` strings itself: ``ratio=1`` arrives as ``1`` (int), ``ridge=None``
    as ``None`` (the method's default), ``pooling=none`` as ``None`` too, ``compile=false`` as
    ``False``; values given as a dict (``--model_args '{...}'``) may still be strings. Raises
    ``ValueError`` naming the option for a value that cannot be cast; the values themselves are
    validated by :class:`JacapConfig` and the method. ``spans=none`` (which lm-eval hands over as ``None``)
    is the value ``"none"``, no word spans: leave ``spans`` out for the method's default.
    """
    types = option_types()
    names = [name for name in kwargs if name in types and not _hf_backend(name, kwargs[name])]
    cast = {name: _cast(name, kwargs.pop(name), types[name]) for name in names}
    return {name: value for name, value in cast.items() if value is not _DEFAULT}


def _refuse_misspelled_options(kwargs: dict) -> None:
    """``ValueError`` for a model argument that ``hf`` does not name and that is one typo from a Jacap option
    (``chunksize`` for ``chunk_size``): ``hf`` passes unknown keys to the model class, which fails after the weights
    load, with a ``TypeError`` that does not name the Jacap options. Other unknown keys are left to ``hf``."""
    import difflib
    import inspect

    known = set(inspect.signature(HFLM.__init__).parameters)
    options = list(option_types())
    for name in kwargs:
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.85) if name not in known else []
        if close:
            raise ValueError(f"hf-jacap: unknown model argument {name!r}: did you mean the Jacap option {close[0]!r}?")


# `backend` is also an `hf` model argument (lm-eval's HFLM: which model class, "default", "causal" or "seq2seq");
# those values stay with HFLM, Jacap's (`auto`, `sdpa`, `xformers`) are the patch's.
HF_BACKENDS = ("default", "causal", "seq2seq")


def _hf_backend(name: str, value) -> bool:
    return name == "backend" and isinstance(value, str) and value.strip().lower() in HF_BACKENDS


def _cast(name: str, value, annotation: str):
    nullable = "None" in annotation
    kind = annotation.split("|")[0].strip()
    if isinstance(value, str) and value.strip().lower() == "none":
        value = None
    if value is None:
        if name == "spans":  # "none" is one of its values (SPANS); None, the method's default, is spans left out
            return "none"
        if nullable:
            return None
        if kind == "str" and name != "method":  # lm-eval turns the string "none" (e.g. pooling=none) into None
            return "none"
        return _DEFAULT
    try:
        if kind == "str":
            return str(value).strip()
        if kind == "bool":
            return _to_bool(value)
        if isinstance(value, bool):
            raise TypeError
        if kind == "int":
            number = float(value) if isinstance(value, str) else value
            if isinstance(number, float) and number.is_integer():
                number = int(number)
            if not isinstance(number, numbers.Integral):
                raise TypeError
            return int(number)
        if kind == "float":
            return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"hf-jacap: option {name} must be {annotation}, got {name}={value!r}") from None
    return value


def _to_bool(value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise ValueError(value)


def _register(name: str):
    """``register_model(name)``, unless ``name`` is already registered: then it is the lazy entry
    (our ``lm_eval.models`` entry point, or ``LM_EVAL_MODEL_TARGET``) whose loading imports this
    module, and lm-eval replaces it with this class itself."""
    def decorate(cls):
        if name in model_registry:
            return cls
        return register_model(name)(cls)
    return decorate


@_register(LM_EVAL_MODEL_NAME)
class JacapLM(HFLM):
    """lm-eval's ``HFLM`` with the model patched by :func:`jacap_attn.patch`.

    Parameters
    ----------
    pretrained, **kwargs:
        As for ``hf`` (``HFLM``): unknown keyword arguments go to ``from_pretrained``. A path or name:
        the model this wrapper loads is patched once, for its lifetime. A loaded model
        (``pretrained=model``, the caller's object): patched only while each ``loglikelihood``,
        ``loglikelihood_rolling`` or ``generate_until`` call runs, then left as it was found
        (unpatched, or patched by its owner with the owner's settings).
    ratio, method, and any other JacapConfig field:
        The compression settings (defaults: ``ratio=0.1``, ``method="jacap"``); options that do not
        apply to ``method`` raise ``ValueError`` before the model is loaded.

    Raises
    ------
    ValueError
        For a bad Jacap setting, an encoder-decoder model, or a model family jacap_attn does not
        support.
    """

    def __init__(self, pretrained, ratio=_RATIO, method=_METHOD, **kwargs) -> None:
        options = pop_jacap_options(kwargs)
        _refuse_misspelled_options(kwargs)  # before the model loads: hf hands unknown keys to the model class
        ratio = _cast("ratio", ratio, "float")
        method = _cast("method", method, "str")
        ratio, method = (_RATIO if ratio is _DEFAULT else ratio), (_METHOD if method is _DEFAULT else method)
        config = JacapConfig.from_options(ratio=ratio, method=method, **options)  # fail before loading the model
        if config.reselect is not None:
            raise ValueError(f"hf-jacap: reselect={config.reselect} would change nothing: no lm-eval request asks a "
                             "question over a stored cache (a context and its continuation are scored in one pass, "
                             "a prompt is generated from in one prefill); drop reselect and set ratio")
        super().__init__(pretrained, **kwargs)
        if self.backend != "causal":
            raise ValueError("hf-jacap supports decoder-only (causal) models only")
        self._patch_args = dict(ratio=ratio, method=method, **options)
        self._config = config
        # A model this wrapper loaded (``pretrained`` a path or name) is its own: patched once, for good.
        # A model it was handed (``pretrained=model``) is the caller's: patched only while a request
        # runs (:meth:`_patched`), then left as it was found, unpatched or patched by its owner.
        self._owns_model = isinstance(pretrained, str)
        if self._owns_model:
            patch(self.model, tokenizer=self.tokenizer, **self._patch_args)
        self.jacap_options = options
        self._rolling = False  # set while loglikelihood_rolling runs (_continuation_logprobs reads it)

    @property
    def jacap_config(self) -> JacapConfig:
        """The settings requests run with (the model is patched with them while they run)."""
        return self._config

    @contextlib.contextmanager
    def _patched(self):
        """The model patched with this wrapper's settings for the duration of the block. A handed
        model (``pretrained=model``) is put back as it was found afterwards: unpatched, or with the
        settings its owner patched it with (the same ``PatchState``, its config, word tables and repeat
        instruction restored), so a later ``HFLM(pretrained=model)`` answers as stock ``hf`` again."""
        state = getattr(self.model, "_jacap_state", None)
        if self._owns_model or (state is not None and state.config == self._config):
            yield
            return
        saved = None if state is None else (state.config, state.spans, state.repeat_ids, state.warned_spans)
        patch(self.model, tokenizer=self.tokenizer, **self._patch_args)
        try:
            yield
        finally:
            if saved is None:
                unpatch(self.model)
            else:
                state.config, state.spans, state.repeat_ids, state.warned_spans = saved

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        with self._patched():
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        config = self._config
        if config.method.compresses and config.ratio < 1 and config.chunk_size is None:
            logger.warning("hf-jacap: loglikelihood_rolling without chunk_size compresses nothing (each window is "
                           "one exact forward, compression comes after a prefill): perplexity equals hf's; pass "
                           "chunk_size=N to score each chunk over the compressed chunks before it")
        self._rolling = True  # its one-token-context windows are prefilled in chunks under chunk_size
        try:
            with self._patched():
                return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        finally:
            self._rolling = False

    def generate_until(self, requests, disable_tqdm: bool = False):
        with self._patched():
            return super().generate_until(requests, disable_tqdm=disable_tqdm)

    def get_model_info(self) -> dict:
        """``hf``'s model information plus the Jacap settings (kept in the results JSON)."""
        config = self.jacap_config
        return {
            **super().get_model_info(),
            "jacap_ratio": config.ratio,
            "jacap_method": config.method.name,
            "jacap_options": dict(self.jacap_options),
            "jacap_config": config.to_dict(),
            "jacap_attn_version": __version__,
        }

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """Score ``requests`` ``[(request_str, context_ids, continuation_ids)]``; returns
        ``[(sum of continuation log-probs, continuation is greedy)]`` in request order.

        Requests are grouped by (left-truncated) context, longest first; within a context, by the
        continuation without its last token, so one forward serves every continuation that differs
        only in its last token (what ``hf``'s ``logits_cache`` does). ``override_bs`` is ignored:
        each context runs alone. With a RoPE type whose frequencies depend on a forward's length
        (``dynamic``, ``longrope``: :func:`jacap_attn.model_state.length_dependent_rope`), a context is
        compressed once per request length, with the frequencies of ``hf``'s single forward over the
        request (:func:`jacap_attn.model_state.rope_for_length`), so ``ratio=1`` equals ``hf`` at batch
        size 1 (``hf`` itself pads a batch, and its frequencies then follow the batch's longest request).
        """
        with self._patched():
            return self._scored(requests, disable_tqdm)

    def _scored(self, requests, disable_tqdm: bool):
        """:meth:`_loglikelihood_tokens` on the patched model."""
        dependent = length_dependent_rope(self.model)
        groups: dict[tuple, dict[tuple, list[int]]] = {}
        for index, (_, context_enc, continuation_enc) in enumerate(requests):
            context = self._truncated_context(context_enc, continuation_enc)
            length = len(context) + len(continuation_enc) - 1 if dependent else None  # hf's forward: ctx + cont[:-1]
            groups.setdefault((context, length), {}).setdefault(tuple(continuation_enc[:-1]), []).append(index)
        results: list = [None] * len(requests)
        pbar = tqdm(total=len(requests), disable=(disable_tqdm or self.rank != 0),
                    desc="Running loglikelihood requests (hf-jacap)")
        for context, length in sorted(groups, key=lambda c: (-len(c[0]), c[0], c[1] or 0)):
            by_prefix = groups[(context, length)]
            with rope_for_length(self.model, length):
                cache = self._compress_context(context)
            for position, (cont_prefix, indices) in enumerate(by_prefix.items()):
                own = cache if position == len(by_prefix) - 1 else copy.deepcopy(cache)  # the last one may consume it
                logprobs = self._continuation_logprobs(context, cont_prefix, own)  # [m, vocab]
                greedy = logprobs.argmax(dim=-1)
                for index in indices:
                    request_str, _, continuation_enc = requests[index]
                    target = torch.tensor(continuation_enc, dtype=torch.long, device=logprobs.device)
                    answer = (float(logprobs.gather(-1, target[:, None]).sum()), bool((greedy == target).all()))
                    results[index] = answer
                    if request_str is not None:
                        self.cache_hook.add_partial("loglikelihood", request_str, answer)
                    pbar.update(1)
        pbar.close()
        return results

    def _truncated_context(self, context_enc: list[int], continuation_enc: list[int]) -> tuple:
        """The context ``hf`` would see: ``(ctx + cont)[-(max_length + 1):]`` minus the continuation."""
        if not context_enc or not continuation_enc:
            raise ValueError("hf-jacap: loglikelihood needs a non-empty context and continuation")
        if len(continuation_enc) > self.max_length:
            raise ValueError(f"hf-jacap: continuation of {len(continuation_enc)} tokens exceeds "
                             f"max_length={self.max_length}")
        whole = (context_enc + continuation_enc)[-(self.max_length + 1):]
        if len(context_enc) + len(continuation_enc) > self.max_length + 1:
            logger.warning("Context (%d) plus continuation (%d) exceed max_length (%d); truncating from the left.",
                           len(context_enc), len(continuation_enc), self.max_length)
        return tuple(whole[: len(whole) - len(continuation_enc)])

    def _autocast(self):
        return torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                              enabled=self.mixed_precision_dtype is not None)

    def _compress_context(self, context: tuple):
        """The compressed cache of ``context[:-1]`` (``None`` for a one-token context)."""
        if len(context) < 2:
            return None
        ids = torch.tensor([context[:-1]], dtype=torch.long, device=self.device)
        with torch.no_grad(), self._autocast():
            return compress(self.model, ids)

    def _continuation_logprobs(self, context: tuple, cont_prefix: tuple, cache) -> torch.Tensor:
        """Log-probs ``[len(cont_prefix) + 1, vocab]`` of the tokens after ``context``: the model reads
        ``[context[-1], *cont_prefix]`` over ``cache`` (``None``: a plain forward, no cache)."""
        tokens = torch.tensor([[context[-1], *cont_prefix]], dtype=torch.long, device=self.device)
        # Under chunk_size a perplexity window longer than a chunk is prefilled in chunks (its own JacapCache, cut
        # as it goes); a loglikelihood continuation is scored over its context's cache, exactly, as after any context
        chunk = self._config.chunk_size
        kwargs = {"use_cache": self._rolling and chunk is not None and tokens.shape[1] > chunk}
        if cache is not None:
            # The cache must hold this very context but its last token (ids and length).
            cache.check_prompt(torch.tensor([context], dtype=torch.long, device=self.device))
            start = len(context) - 1  # logical position of context[-1]
            positions = torch.arange(start, start + tokens.shape[1], device=self.device)[None]
            kwargs = {"use_cache": True, "position_ids": positions, self.model._jacap_state.cache_keyword: cache}
        with torch.no_grad(), self._autocast():
            logits = self.model(input_ids=tokens, **kwargs).logits[0]
        return F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype)

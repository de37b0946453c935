"""`Document`: a compressed prompt that answers any number of later questions
(docs/cache.md#documents).

    doc = jacap_attn.Document.compress(model, doc_ids)        # or Document.load(path, model)
    doc.save("doc.safetensors")
    for q_ids in questions:
        new_ids = doc.generate(q_ids, max_new_tokens=32)      # the question's tokens only

Each question runs on a copy of the stored cache (the stored one is never changed), with the ids
``prompt + question`` and the attention mask that ``generate`` needs built for you.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import numbers

import torch

from .storage.cache import COMPRESSED, JacapCache
from .patching import compress
from .route_settings import document_chunking
from .models import check_token_ids
from .files.persist import load_cache_and_metadata, prompt_format_json, save_cache


# Default stored kept fraction of Document.compress: the document whole, reselected per question
# (measured: README "Question asked after compression", eval/results/quality_smollm2_heldout_agnostic.md
# and eval/results/quality_gemma3-270m_heldout_agnostic.md).
STORE = 1.0
# Default entries of a saved Document: 8 bits (keys per channel, values per token; about 0.27 of the
# float32 bytes), chosen by the rule of docs/method.md#a-compressed-document-by-default-the-rule-issue-24
# (candidate C); None: the cache's dtype, exact. `save_cache` itself stores exact entries by default.
FILE_QUANTIZE = "int8"


class Document:
    """A compressed prompt cache with its prompt ids, for answering many questions.

    Parameters
    ----------
    model: the patched model that made ``cache``.
    cache: a compressed :class:`~jacap_attn.storage.cache.JacapCache` of ``prompt_ids`` (from
        :func:`jacap_attn.compress` or :func:`jacap_attn.load_cache`); never modified.
    prompt_ids: ``[b, n]`` int64 the prompt it holds (left padding included); ``None`` reads
        ``cache.prompt_ids``.
    prompt_format: optional JSON-able facts about how the prompt was built (saved with it; the CLI
        uses ``{"chat": bool}``).

    Raises ``ValueError`` if the cache is not compressed, or its prompt ids are unknown or do not match.

    ``pickle``/``copy.deepcopy`` of a document carry its model too (hundreds of MB for a small model): to keep
    or send the document alone, :meth:`save` it (its entries, 8-bit by default) and :meth:`load` it beside the model.
    """

    def __init__(self, model, cache: JacapCache, prompt_ids: torch.Tensor | None = None, *,
                 prompt_format: dict | None = None):
        prompt_format_json(prompt_format)  # a dict of JSON-able values, checked before any work
        if not isinstance(cache, JacapCache) or cache.state != COMPRESSED:
            raise ValueError("Document needs a compressed JacapCache (from jacap_attn.compress or load_cache)")
        ids = cache.prompt_ids if prompt_ids is None else prompt_ids
        if ids is None:
            raise ValueError("Document needs the prompt ids: this cache has none (a file saved with "
                             "store_ids=False); pass prompt_ids=")
        ids = torch.as_tensor(ids)
        if ids.dim() == 1:
            ids = ids[None]
        if cache._matches_prompt(ids) is False:
            raise ValueError("prompt_ids are not the prompt this cache holds (ids or prompt_sha256 differ)")
        self.model, self.cache, self.prompt_ids = model, cache, ids.detach().clone()
        self.prompt_format = prompt_format
        self.pads = cache.layers[0].pads.detach().cpu()

    @classmethod
    def compress(cls, model, prompt_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 prompt_format: dict | None = None, store: float | None = STORE,
                 chunk_size: int | None = None) -> "Document":
        """Compress ``prompt_ids [b, n]`` (``attention_mask`` for left-padded rows) with the patched
        ``model`` for questions asked later.

        ``store``: kept fraction of the stored cache, in (0, 1]. Above the patched ``ratio``, the
        document is stored at ``store`` and each question of two or more tokens reselects it to the
        patched ``reselect`` if set, else to ``ratio``, with its own queries (``reselect``,
        docs/method.md#question-time-reselection): that is the decode budget. A one-token question
        does not reselect (it decodes over the stored cache). Methods that read every prompt query
        (H2O) cannot reselect and are stored at the patched settings. Default :data:`STORE` (1.0, stored whole): question-agnostic, it kept the full
        cache's accuracy at a 25% and 10% decode budget on both models, where storing at the budget
        lost it (README, "Question asked after compression"); the price is the stored size.
        ``None`` or ``store == ratio``: stored at the patched settings (:func:`jacap_attn.compress`),
        e.g. ``ratio=0.25, queries="repeat"`` for a file 4x smaller.

        ``chunk_size``: prefill the document in chunks of that many tokens, each cut to ``store`` of the
        tokens so far (docs/usage.md#chunked-prefill; default: the patched ``chunk_size``). A document
        stored whole is never cut, so chunks bound its memory only with ``store`` below 1. Where the
        patched settings leave them unset, the chunk cuts are scored by a repeat pass and carry the mass of
        near-duplicate evicted entries (``chunk_mass=True, mass_cosine=0.95``:
        :func:`jacap_attn.route_settings.document_chunking`).

        Raises ``ValueError`` for a model that is not patched, a ``store`` outside (0, 1] or below a compressing
        method's ``ratio``, a bad ``chunk_size``, a ``prompt_format`` that is not a JSON-able dict or token ids
        outside the vocabulary, before any work."""
        prompt_format_json(prompt_format)  # a dict of JSON-able values, checked before any work
        state = getattr(model, "_jacap_state", None)
        if state is None:
            raise ValueError("Document.compress needs a patched model: call jacap_attn.patch(model, ...) first")
        config = None
        if store is not None:
            if isinstance(store, bool) or not isinstance(store, numbers.Real) or not 0.0 < float(store) <= 1.0:
                raise ValueError(f"store must be a kept fraction in (0, 1] or None, got store={store!r}")
            cfg = state.config
            if float(store) < cfg.ratio and cfg.method.compresses:  # said, not stored at `ratio` silently
                raise ValueError(f"store={store!r} is below the patched ratio={cfg.ratio}: a document holds at least what "
                                 f"a question decodes over; pass store=None (stored at the patched settings) or a "
                                 f"fraction of at least {cfg.ratio}")
            # Methods that read every prompt query (H2O) cannot reselect: stored as patched.
            if float(store) > cfg.ratio and cfg.method.compresses and not cfg.method.needs_all_queries:
                reselect = cfg.reselect if cfg.reselect is not None else cfg.ratio
                running = None if cfg.chunk_ratio is None else max(cfg.chunk_ratio, float(store))
                config = dataclasses.replace(cfg, ratio=float(store), reselect=reselect, chunk_ratio=running)
        base = config if config is not None else state.config
        if chunk_size is not None or base.chunk_size is not None:
            # questions come after compression: question-agnostic cuts, near-duplicates' mass carried
            # (docs/method.md, "Chunk cuts scored by use" and "Carried mass for near-duplicates ...")
            changes = document_chunking(base)
            config = dataclasses.replace(base, **changes) if changes else config
        cache = compress(model, prompt_ids, attention_mask, config=config, chunk_size=chunk_size)
        return cls(model, cache, prompt_ids, prompt_format=prompt_format)

    @classmethod
    def load(cls, path, model, *, prompt_ids: torch.Tensor | None = None, **kwargs) -> "Document":
        """Load a file saved by :meth:`save` or :func:`jacap_attn.save_cache`, in this process or a fresh
        one: ``model`` is the model that made it (the same weights), patched or not; ``prompt_ids``
        ``[b, n]`` the prompt of a file saved without it (``store_ids=False``; checked against the file's
        ``prompt_sha256``); other keyword arguments as for :func:`jacap_attn.load_cache` (``device``,
        ``dtype``, ``reselect``, ``tokenizer``).

        The rule of :func:`jacap_attn.load_cache` (docs/cache.md#load-checks): the document answers with
        the settings it was saved with (stored kept fraction, method, decode budget ``reselect``: a
        document stored whole by :meth:`compress` reselects to the ratio it was compressed for), the
        patched model's apply to its new prefills only, an explicit ``reselect=`` overrides (``False``:
        none). An unpatched ``model`` is patched with the file's settings.

        Raises :class:`~jacap_attn.files.persist.CacheFileError` (a ``ValueError``) as ``load_cache`` does, and
        ``ValueError`` for a file saved without its prompt ids and no ``prompt_ids``, or ``prompt_ids`` that
        are not its prompt."""
        return cls.load_with_metadata(path, model, prompt_ids=prompt_ids, **kwargs)[0]

    @classmethod
    def load_with_metadata(cls, path, model, *, prompt_ids: torch.Tensor | None = None,
                           **kwargs) -> tuple["Document", dict]:
        """:meth:`load`, and the file's checked header metadata (``read_cache_metadata``'s dict of strings) from
        the same read: a file replaced meanwhile is one version, never the header of one and the entries of another."""
        cache, metadata = load_cache_and_metadata(path, model, **kwargs)
        fmt = json.loads(metadata["prompt_format"]) if "prompt_format" in metadata else None
        return cls(model, cache, prompt_ids, prompt_format=fmt), metadata

    def save(self, path, *, quantize: str | None = FILE_QUANTIZE, store_ids: bool = True,
             prompt_format: dict | None = None) -> int:
        """Save to ``path`` (:func:`jacap_attn.save_cache`; returns the file size). ``quantize``: the
        entries in 8 bits (``"int8"``, the default since 2026-12-01: about 0.27 of float32's bytes,
        0.53 of bfloat16's; decoded on load, docs/cache.md#quantized-files) or ``None`` (the cache's
        dtype, exact). ``store_ids`` and ``prompt_format`` (default: the document's own) as for
        :func:`jacap_attn.save_cache`."""
        return save_cache(self.cache, path, model=self.model, prompt_ids=self.prompt_ids, quantize=quantize,
                          store_ids=store_ids,
                          prompt_format=self.prompt_format if prompt_format is None else prompt_format)

    @property
    def length(self) -> int:
        """Tokens of the prompt (padding included)."""
        return self.prompt_ids.shape[1]

    def fresh_cache(self, *, reselect: float | None | str = "keep") -> JacapCache:
        """A copy of the stored cache, to continue once; ``reselect`` replaces its question-time
        reselection setting (a kept fraction, or ``None`` or ``False`` for off, as ``load_cache`` takes
        it; default: unchanged)."""
        cache = copy.deepcopy(self.cache)
        if reselect is False:
            reselect = None
        if isinstance(reselect, str) and reselect == "keep":
            return cache
        cache.config = dataclasses.replace(cache.config, reselect=reselect)
        return cache

    def inputs(self, question_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, attention_mask)`` ``[b, n + q]`` for ``generate``: the prompt, then ``question_ids``
        (``[q]``, ``[1, q]`` repeated over the rows, or ``[b, q]``: the new tokens only, unpadded).

        Raises ``ValueError`` for an empty question, or one that starts with the whole prompt (pass
        only the tokens after it)."""
        q = torch.as_tensor(question_ids)
        if q.dtype.is_floating_point or q.dtype.is_complex or q.dtype == torch.bool:
            raise ValueError(f"question_ids must be integer token ids, got dtype {q.dtype}")
        q = q.to(self.prompt_ids.device, torch.int64)
        if q.dim() == 1:
            q = q[None]
        b, n = self.prompt_ids.shape
        if q.dim() != 2 or q.shape[1] == 0 or q.shape[0] not in (1, b):
            rows = "1" if b == 1 else f"1 or {b}"
            raise ValueError(f"question_ids must be [q] or [{rows}, q] new token ids, got {tuple(q.shape)}")
        q = q.expand(b, -1)
        if q.shape[1] >= n and torch.equal(q[:, :n], self.prompt_ids):
            raise ValueError(f"question_ids start with the {n}-token prompt the document holds: pass only the "
                             "tokens after it")
        check_token_ids(self.model, q, "question_ids")
        ids = torch.cat([self.prompt_ids, q], dim=1)
        mask = torch.ones_like(ids)
        mask[:, :n] = (torch.arange(n)[None, :] >= self.pads[:, None]).to(mask.dtype)
        return ids, mask

    def generate(self, question_ids: torch.Tensor, *, reselect: float | None | str = "keep",
                 **generate_kwargs) -> torch.Tensor:
        """Answer: ``model.generate`` over a copy of the stored cache, on the prompt followed by
        ``question_ids`` (see :meth:`inputs`). ``reselect`` as for :meth:`fresh_cache`; other keyword
        arguments go to ``generate`` (``max_new_tokens``, ``do_sample``, ...). Returns the new tokens
        only, ``[b, new]`` (a ``generate`` output object when ``return_dict_in_generate=True``). The
        stored cache is left unchanged."""
        ids, mask = self.inputs(question_ids)
        generate_kwargs.setdefault("attention_mask", mask)
        out = self.model.generate(ids, cache=self.fresh_cache(reselect=reselect), **generate_kwargs)
        if isinstance(out, torch.Tensor):
            return out[:, ids.shape[1]:]
        return out

    def ask(self, question: str, tokenizer, *, chat: bool | None = None, max_new_tokens: int = 64,
            **generate_kwargs) -> str:
        """Answer the text ``question`` for a single-row document built with
        :func:`jacap_attn.prompts.format_prompt` (``question_position="none"``; the default layout) or
        :func:`jacap_attn.prompts.split_chat` (``prompt_format`` ``{"layout": "split_chat", "separator":
        ..., "system": ...}``): the question part of that layout is tokenized and greedy-decoded
        (``max_new_tokens``). ``chat``: the layout's form (default: the saved ``prompt_format``'s, else
        whether the tokenizer has a chat template). Returns the decoded answer.

        Raises ``ValueError`` for a question that is not a string or is empty (whitespace only), before
        any work, as ``jacap ask`` does, for a document of several rows, and where the document, the question's
        tokens and ``max_new_tokens`` exceed the model's context (:func:`jacap_attn.models.context_limit`)."""
        from .models import context_limit
        from .prompts import format_question, split_chat

        if not isinstance(question, str):
            raise ValueError(f"question must be a string, got {type(question).__name__}")
        if not question.strip():
            raise ValueError(f"question {question!r} is empty: ask something (a question of at least one word)")
        if self.prompt_ids.shape[0] != 1:
            raise ValueError(f"ask answers a single-row document; this one has {self.prompt_ids.shape[0]} rows: "
                             "use generate(question_ids) for a batch")
        fmt = self.prompt_format or {}
        if chat is None:
            chat = fmt.get("chat")
        if fmt.get("layout") == "split_chat":
            suffix = split_chat(tokenizer, "x", question, system=fmt.get("system"),
                                separator=fmt.get("separator", "\n\n"))[1]
        else:
            suffix = format_question({"context": "", "question": question}, tokenizer, chat=chat)
        q = torch.tensor(tokenizer(suffix, add_special_tokens=False)["input_ids"])
        limit = context_limit(self.model)
        if limit and self.length + len(q) + max_new_tokens > limit:
            raise ValueError(f"the document ({self.length:,} tokens), the question ({len(q):,}) and max_new_tokens "
                             f"({max_new_tokens:,}) exceed the model's context of {limit:,} tokens "
                             "(config.max_position_embeddings): ask a shorter question or fewer new tokens")
        generate_kwargs.setdefault("do_sample", False)
        generate_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
        new = self.generate(q, max_new_tokens=max_new_tokens, **generate_kwargs)
        return tokenizer.decode(new[0], skip_special_tokens=True).strip()


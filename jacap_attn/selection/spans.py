"""Word spans of a prompt, and keeping them whole (docs/method.md#d8-answers-kept-whole).

Tokenizers cut a value into several tokens: SmolLM2 and Gemma 3 write ``" 5594285"`` as ``" "`` plus
one token per digit, a UUID as a dozen pieces. A selection that ranks tokens one by one can keep
some digits of a value and evict others, and the model then copies the digits it still sees and
invents the rest. A *span* here is a whitespace-delimited word: a token starts a new span when its
text begins with whitespace (byte-level BPE's ``Ġ``/``Ċ``, SentencePiece's ``▁``, a space, a
newline or tab, a byte-fallback token), when it is a special token, or when it follows a special
token; every other token continues the span before it (digits after digits, subword pieces,
punctuation attached to a word).

:func:`word_starts` reads that table off a tokenizer's vocabulary once; :func:`span_ids` numbers
the spans of prompt ids; :func:`pool_spans` gives every token of a span the largest score of the
span, so a span ranks, and is kept, as a whole (spans longer than ``max_len`` tokens, the config's
``max_span``, are left token by token). Pure functions of tensors, but for :func:`word_starts`, which reads a tokenizer.
"""

from __future__ import annotations

import functools
import os

import torch

_WHITESPACE = frozenset(" \t\n\r\u0120\u010a\u0109\u2581")  # space, tab, newline, CR, Ġ, Ċ, ĉ, ▁


def word_starts(tokenizer) -> torch.Tensor:
    """``[vocab]`` bool: whether each token id starts a new word (see the module docstring). Reads
    ``tokenizer.convert_ids_to_tokens`` over ``range(len(tokenizer))`` once (a fraction of a second for
    a 262k vocabulary); special tokens (``all_special_ids``) and byte-fallback tokens (``<0x..>``)
    start a word. Raises ``ValueError`` for an object that is not a Hugging Face tokenizer."""
    if not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise ValueError(f"word spans need a Hugging Face tokenizer, got {type(tokenizer).__name__}")
    size = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    starts = torch.tensor([not t or t[0] in _WHITESPACE or (t.startswith("<0x") and t.endswith(">"))
                           for t in tokens], dtype=torch.bool)
    return starts | special_table(tokenizer, size)


def special_table(tokenizer, size: int) -> torch.Tensor:
    """``[size]`` bool: the tokenizer's special token ids (a new span starts after each)."""
    table = torch.zeros(size, dtype=torch.bool)
    special = [i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < size]
    table[special] = True
    return table


@functools.lru_cache(maxsize=8)
def _tables_from_folder(path: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # no tokenizer files there, or one transformers cannot read
        return None
    return vocabulary_tables(tokenizer)


def vocabulary_tables(tokenizer):
    """``(starts, specials, clauses)`` of a tokenizer: :func:`word_starts`, :func:`special_table` and
    :func:`clause_table` (the last for clause units, docs/method.md#d9-clause-units-for-the-consensus)."""
    return word_starts(tokenizer), special_table(tokenizer, len(tokenizer)), clause_table(tokenizer)


@functools.lru_cache(maxsize=8)
def _tables_from_gguf(path: str, gguf_file: str):
    from transformers import AutoTokenizer

    try:  # transformers builds the tokenizer from the file's metadata (its vocabulary and merges)
        tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file, local_files_only=True)
    except Exception:  # the file is gone, or holds no tokenizer transformers can read
        return None
    return vocabulary_tables(tokenizer)


def gguf_source(model) -> tuple[str, str] | None:
    """``(folder or hub id, GGUF file)`` a model loaded with ``from_pretrained(path, gguf_file=...)``
    came from, as transformers records it (``config.quantization_config.gguf_file``, beside
    ``name_or_path``; an absolute ``gguf_file`` is split into its folder and name); else, for a local
    ``name_or_path`` folder holding exactly one ``.gguf`` file, that file. ``None`` otherwise."""
    config = getattr(model, "config", None)
    record = getattr(config, "quantization_config", None)
    name = record.get("gguf_file") if isinstance(record, dict) else getattr(record, "gguf_file", None)
    path = getattr(model, "name_or_path", None) or getattr(config, "name_or_path", None)
    path = path if isinstance(path, str) and path else None
    if isinstance(name, str) and name:
        if os.path.isabs(name) or (path is None and os.path.isfile(name)):
            return os.path.dirname(os.path.abspath(name)), os.path.basename(name)
        return None if path is None else ((os.path.abspath(path) if os.path.isdir(path) else path), name)
    if path is not None and os.path.isdir(path):
        found = [entry for entry in os.listdir(path) if entry.endswith(".gguf")]
        if len(found) == 1:
            return os.path.abspath(path), found[0]
    return None


def tables(model, tokenizer=None):
    """``(starts, specials, clauses)``, ``[vocab]`` bool, bool and int8 (:func:`vocabulary_tables`), for
    ``model``: from ``tokenizer`` when given, else
    from the tokenizer files of ``model.name_or_path``: the model's local folder (as ``from_pretrained``
    of a folder and :func:`jacap_attn.models.load_model` leave it) or a hub id already in the local
    Hugging Face cache (``local_files_only``: never a download), else from the GGUF file the model was
    loaded from (:func:`gguf_source`: a local folder or the Hugging Face cache); read once per folder
    or file. ``None`` when none is there (spans are then off, and :func:`jacap_attn.patch` warns)."""
    if tokenizer is not None:
        return vocabulary_tables(tokenizer)
    path = getattr(model, "name_or_path", None)
    found = None
    if isinstance(path, str) and path:
        found = _tables_from_folder(os.path.abspath(path) if os.path.isdir(path) else path)
    source = gguf_source(model) if found is None else None
    return _tables_from_gguf(*source) if source is not None else found


def span_ids(ids: torch.Tensor, starts: torch.Tensor, specials: torch.Tensor | None = None) -> torch.Tensor:
    """``[b, n]`` int64 span index of every position of ``ids [b, n]`` (0 for the first span of a row,
    non-decreasing along the row). ``starts [vocab]`` bool from :func:`word_starts`; ``specials``
    ``[vocab]`` bool marks ids after which a new span starts too (special tokens). An id outside the
    table starts a span. Position 0 always starts one."""
    ids = ids.to(starts.device)
    known = (ids >= 0) & (ids < starts.shape[0])
    clamped = ids.clamp(0, starts.shape[0] - 1)
    begin = ~known | starts[clamped]
    if specials is not None:
        after = torch.zeros_like(begin)
        after[:, 1:] = specials.to(starts.device)[clamped[:, :-1]] & known[:, :-1]
        begin = begin | after
    begin[:, 0] = True
    return begin.long().cumsum(-1) - 1


def pool_spans(scores: torch.Tensor, spans: torch.Tensor, max_len: int) -> torch.Tensor:
    """Every token of a span gets the largest score of its span: ``scores [b, h, n]`` float, ``spans``
    ``[b, n]`` (shared by the heads) or ``[b, h, n]`` int64 non-negative labels (a span is the positions
    sharing one; :func:`span_ids` gives them). Spans longer than ``max_len`` tokens keep their tokens'
    own scores. Returns float32 ``[b, h, n]``; ``-inf`` stays ``-inf`` where a whole span is ``-inf``."""
    b, h, n = scores.shape
    s = scores.float()
    index = (spans[:, None, :] if spans.dim() == 2 else spans).to(s.device).expand(b, h, n)
    size = int(index.max()) + 1 if index.numel() else 1
    best = torch.full((b, h, size), float("-inf"), device=s.device).scatter_reduce(2, index, s, "amax",
                                                                                   include_self=True)
    length = torch.zeros(b, h, size, dtype=torch.int64, device=s.device).scatter_add_(2, index, torch.ones_like(index))
    short = length.gather(2, index) <= max_len
    return torch.where(short, best.gather(2, index), s)


# --------------------------------------------------------------------------------------------
# Units larger than a word: clauses and fixed chunks (docs/method.md#look-alike-retrieval-issue-34)
# --------------------------------------------------------------------------------------------

_SENTENCE_PUNCT = frozenset(".!?")
_CLAUSE_PUNCT = frozenset(";:")  # end a clause, not a sentence ("... is: 1234567." keeps its value)
_NEWLINES = frozenset("\n\r\u010a\u010d")  # newline, CR and byte-level BPE's Ċ, č


def clause_table(tokenizer) -> torch.Tensor:
    """``[vocab]`` int8: how each token id ends a clause. 2: its text holds a newline (it always ends
    one); 1: its text ends with sentence punctuation (``. ! ?``), 3: with clause punctuation (``; :``),
    either of which ends a clause when the next token starts a word (so ``3.14`` and ``os.path`` stay
    one clause; a sentence, :func:`clause_ids` with ``sentences=True``, ends at 1 only); 0: none of
    these. Special tokens are 2.
    Reads ``tokenizer.convert_ids_to_tokens`` once, like :func:`word_starts`; ``ValueError`` for an
    object that is not a Hugging Face tokenizer."""
    if not hasattr(tokenizer, "convert_ids_to_tokens"):
        raise ValueError(f"clause units need a Hugging Face tokenizer, got {type(tokenizer).__name__}")
    size = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    ends = [t.rstrip(" \t\u0120\u2581")[-1:] if t else "" for t in tokens]
    kinds = [2 if t and any(c in _NEWLINES for c in t) else 1 if end in _SENTENCE_PUNCT else
             3 if end in _CLAUSE_PUNCT else 0 for t, end in zip(tokens, ends)]
    table = torch.tensor(kinds, dtype=torch.int8)
    table[special_table(tokenizer, size)] = 2
    return table


def _capped(begin: torch.Tensor, max_len: int) -> torch.Tensor:
    """Unit labels ``[b, n]`` from unit starts ``begin [b, n]`` bool, a unit longer than ``max_len``
    split into consecutive pieces of ``max_len`` tokens."""
    n = begin.shape[-1]
    pos = torch.arange(n, device=begin.device).expand_as(begin)
    start = torch.where(begin, pos, torch.zeros_like(pos)).cummax(-1).values
    begin = begin | ((pos - start) % max_len == 0)
    return begin.long().cumsum(-1) - 1


def clause_ids(ids: torch.Tensor, starts: torch.Tensor, clauses: torch.Tensor, specials: torch.Tensor | None = None,
               max_len: int = 64, sentences: bool = False) -> torch.Tensor:
    """``[b, n]`` int64 clause label of every position of ``ids [b, n]`` (0 for the first clause of a
    row, non-decreasing). A clause ends after a token holding a newline, after clause punctuation
    followed by a word start (:func:`clause_table`, :func:`word_starts`), and before and after a special
    token (``specials [vocab]`` bool); a clause longer than ``max_len`` tokens is cut into pieces of
    ``max_len``. An id outside the tables ends a clause. The fact "The access code for the Marlow-7
    vault is 5594285." is one clause, key and value together. ``sentences``: ``; :`` end nothing, so
    RULER's needle "One of the special magic numbers for X is: 1234567." is one unit too (as clauses
    its key and value are two, and a consensus carried to the end of the key's unit misses the value:
    docs/method.md#d9-clause-units-for-the-consensus)."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    ids = ids.to(starts.device)
    known = (ids >= 0) & (ids < starts.shape[0]) & (ids < clauses.shape[0])
    clamped = ids.clamp(0, min(starts.shape[0], clauses.shape[0]) - 1)
    kind = torch.where(known, clauses.to(starts.device)[clamped].long(), torch.full_like(ids, 2))
    kind = kind.masked_fill(kind == 3, 0 if sentences else 1)
    word = ~known | starts[clamped]
    special = torch.zeros_like(word) if specials is None else known & specials.to(starts.device)[clamped]
    begin = torch.zeros_like(word)
    begin[:, 1:] = (kind[:, :-1] == 2) | ((kind[:, :-1] == 1) & word[:, 1:]) | special[:, :-1] | special[:, 1:]
    begin[:, 0] = True
    return _capped(begin, max_len)


def chunk_ids(key_valid: torch.Tensor, size: int, pads: torch.Tensor | None = None) -> torch.Tensor:
    """``[b, n]`` int64 labels of fixed chunks of ``size`` real tokens (ChunkKV's units, Liu et al.,
    arXiv:2502.00299), counted from each row's first real token, so a left-padded row is cut as the
    same row alone; every padding position takes label 0 (padding ranks ``-inf`` anyway), real
    chunks 1, 2, ... ``key_valid [b, n]`` bool, left padding only; or, given ``pads [b]`` (each row's
    left padding), chunks of positions ``index - pads`` over an index space whose ``key_valid`` may
    have holes (entries no head holds any more), so a chunk is the same positions at every cut.
    ``ValueError`` for ``size < 1``."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    if pads is None:
        real = key_valid.long().cumsum(-1) - 1  # index among the row's real tokens
    else:
        real = torch.arange(key_valid.shape[-1], device=key_valid.device) - pads.to(key_valid.device)[:, None]
    return torch.where(key_valid, real.clamp_min(0) // size + 1, torch.zeros_like(real))

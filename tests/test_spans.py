"""Words kept whole (``spans="words"``, docs/method.md#d8-answers-kept-whole; issue 23)."""

from __future__ import annotations

import warnings

import pytest
import torch

import jacap_attn
from conftest import random_ids, tiny_model
from jacap_attn.selection import spans


class WordTokenizer:
    """A stand-in with the two things :func:`jacap_attn.selection.spans.word_starts` reads: ids 0-2 special,
    ids 3-49 start a word ("Ġw<i>"), ids 50-95 continue one ("c<i>", e.g. the digits of a number)."""

    all_special_ids = [0, 1, 2]

    def __len__(self):
        return 96

    def convert_ids_to_tokens(self, ids):
        return ["<s>" if i < 3 else (f"\u0120w{i}" if i < 50 else f"c{i}") for i in ids]


def test_word_starts_read_whitespace_markers_and_special_tokens():
    starts = spans.word_starts(WordTokenizer())
    assert starts[:50].all() and not starts[50:].any()
    with pytest.raises(ValueError, match="Hugging Face tokenizer"):
        spans.word_starts(object())


def test_span_ids_and_pooling_give_a_word_its_best_score():
    starts = spans.word_starts(WordTokenizer())
    specials = spans.special_table(WordTokenizer(), 96)
    ids = torch.tensor([[0, 60, 10, 60, 61, 62, 11, 63]])  # <s> | c60 (after a special: new) | w10 c c c | w11 c
    labels = spans.span_ids(ids, starts, specials)
    assert labels.tolist() == [[0, 1, 2, 2, 2, 2, 3, 3]]
    scores = torch.tensor([[[0.0, 1.0, 0.1, 0.9, 0.2, 0.3, 0.5, -1.0]]])
    pooled = spans.pool_spans(scores, labels, max_len=16)
    assert pooled[0, 0].tolist() == pytest.approx([0.0, 1.0, 0.9, 0.9, 0.9, 0.9, 0.5, 0.5])
    # A word longer than max_len keeps its tokens' own scores.
    assert spans.pool_spans(scores, labels, max_len=3)[0, 0, 2:6].tolist() == pytest.approx([0.1, 0.9, 0.2, 0.3])


def _word_ids(n: int, seed: int = 1) -> torch.Tensor:
    """Prompt ids made of words of 1-7 tokens (a start id, then continuation ids)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < n:
        out.append(int(torch.randint(3, 50, (1,), generator=gen)))
        out += torch.randint(50, 96, (int(torch.randint(0, 7, (1,), generator=gen)),), generator=gen).tolist()
    return torch.tensor([out[:n]])


def test_words_kept_whole_at_the_same_budget():
    """With the model's vocabulary, every kept word outside the budget's last word is kept whole in every
    compressed layer and KV head, and the kept count is the budget's; without it (or spans="none")
    words are cut where the ranking cuts them."""
    model = tiny_model("llama")
    ids = _word_ids(120)
    starts = spans.word_starts(WordTokenizer())
    labels = spans.span_ids(ids, starts, spans.special_table(WordTokenizer(), 96))[0]
    cut = {}
    for setting in ("words", "none"):
        jacap_attn.patch(model, ratio=0.3, window=8, tokenizer=WordTokenizer(), spans=setting, budget="uniform")
        cache = jacap_attn.compress(model, ids)
        broken = 0
        for layer in cache.layers:
            keys, values, positions, valid = layer.export()
            assert int(valid[0, 0].sum()) == 36  # ceil(0.3 * 120): the budget is unchanged
            for h in range(positions.shape[1]):
                kept = set(positions[0, h][valid[0, h]].tolist())
                words = {}
                for i in range(120):
                    words.setdefault(int(labels[i]), []).append(i in kept)
                broken += sum(any(w) and not all(w) for w in words.values())
        cut[setting] = broken
        jacap_attn.unpatch(model)
    # At most the budget's last word is cut, per layer and head (and the window's first word).
    assert cut["words"] <= 2 * 3 * 2 < cut["none"]


def test_a_prefill_without_token_ids_says_its_words_are_not_kept_whole():
    """A prefill from ``inputs_embeds`` has no ids to find words in: it is cut token by token and
    says so (it used to differ from the same prompt's ``input_ids`` prefill silently); with
    ``input_ids`` nothing is said."""
    model = tiny_model("llama")
    ids = _word_ids(120)
    jacap_attn.patch(model, ratio=0.3, window=8, tokenizer=WordTokenizer(), spans="words")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jacap_attn.compress(model, ids)
        with torch.no_grad():  # a prompt the cut keeps whole (under min_tokens) has no words to cut: silent
            jacap_attn.patch(model, ratio=0.3, window=8, tokenizer=WordTokenizer(), spans="words", min_tokens=200)
            model(inputs_embeds=model.get_input_embeddings()(ids), cache=jacap_attn.JacapCache(model))
            jacap_attn.patch(model, ratio=0.3, window=8, tokenizer=WordTokenizer(), spans="words")
    with pytest.warns(UserWarning, match="spans='words' needs the prompt's token ids"):
        cache = jacap_attn.JacapCache(model)
        with torch.no_grad():
            model(inputs_embeds=model.get_input_embeddings()(ids), cache=cache)
    jacap_attn.unpatch(model)


def test_spans_are_off_without_a_vocabulary_and_validated():
    model = tiny_model("llama")  # built from a config: no local folder, no tokenizer
    jacap_attn.patch(model, ratio=0.3, window=8, spans="words")
    assert model._jacap_state.spans is None  # asked for, but no vocabulary: token by token
    plain = jacap_attn.compress(model, random_ids(1, 60))
    jacap_attn.patch(model, ratio=0.3, window=8, spans="none")
    same = jacap_attn.compress(model, random_ids(1, 60))
    assert all(torch.equal(a.export()[2], b.export()[2]) for a, b in zip(plain.layers, same.layers))
    with pytest.raises(ValueError, match="spans must be one of"):
        jacap_attn.patch(model, ratio=0.3, spans="sentences")
    assert jacap_attn.JacapConfig(method="snapkv").spans == "none"
    assert jacap_attn.JacapConfig().spans == "words" and jacap_attn.JacapConfig().max_span == 64  # Jacap: D8


def test_reselection_keeps_held_words_whole():
    """Question-time reselection ranks a held word as its best token too."""
    model = tiny_model("llama")
    ids = _word_ids(120, seed=3)
    labels = spans.span_ids(ids, spans.word_starts(WordTokenizer()), spans.special_table(WordTokenizer(), 96))[0]
    broken = {}
    for setting in ("words", "none"):
        jacap_attn.patch(model, ratio=1.0, reselect=0.25, window=8, tokenizer=WordTokenizer(), spans=setting)
        cache = jacap_attn.compress(model, ids)
        question = random_ids(1, 10, seed=5)
        with torch.no_grad():
            model(input_ids=question, cache=cache, position_ids=torch.arange(120, 130)[None])
        count = 0
        for layer in cache.layers:
            _, _, positions, valid = layer.export()
            for h in range(positions.shape[1]):
                kept = {p for p in positions[0, h][valid[0, h]].tolist() if p < 120}
                words = {}
                for i in range(120):
                    words.setdefault(int(labels[i]), []).append(i in kept)
                count += sum(any(w) and not all(w) for w in words.values())
        broken[setting] = count
        jacap_attn.unpatch(model)
    assert broken["words"] < broken["none"]


def _long_word_ids(n: int, length: int) -> torch.Tensor:
    """Prompt ids of words of ``length`` tokens each (a start id, then continuation ids), like a
    UUID's 32-35 tokens."""
    gen = torch.Generator().manual_seed(7)
    out = []
    while len(out) < n:
        out.append(int(torch.randint(3, 50, (1,), generator=gen)))
        out += torch.randint(50, 96, (length - 1,), generator=gen).tolist()
    return torch.tensor([out[:n]])


def _cut_words(cache, labels) -> int:
    """Words of ``labels [n]`` kept in part (some tokens kept, others not), over layers and KV heads."""
    n = labels.shape[0]
    count = 0
    for layer in cache.layers:
        _, _, positions, valid = layer.export()
        for h in range(positions.shape[1]):
            kept = set(positions[0, h][valid[0, h]].tolist())
            words = {}
            for i in range(n):
                words.setdefault(int(labels[i]), []).append(i in kept)
            count += sum(any(w) and not all(w) for w in words.values())
    return count


def test_max_span_keeps_words_up_to_its_length_whole():
    """Words of 24 tokens (a UUID is 32-35) are kept whole under the default cap (64), and ranked token
    by token under ``max_span=16``, the cap before 2026-12-01; ``max_span`` is validated."""
    model = tiny_model("llama")
    ids = _long_word_ids(240, 24)
    labels = spans.span_ids(ids, spans.word_starts(WordTokenizer()), spans.special_table(WordTokenizer(), 96))[0]
    cut = {}
    for cap in (None, 16):
        options = {} if cap is None else {"max_span": cap}
        jacap_attn.patch(model, ratio=0.3, window=8, tokenizer=WordTokenizer(), spans="words", budget="uniform",
                         **options)
        assert model._jacap_state.config.max_span == (cap or 64)
        cut[cap] = _cut_words(jacap_attn.compress(model, ids), labels)
        jacap_attn.unpatch(model)
    # Under the default cap at most the budget's last word and the window's first are cut per head.
    assert cut[None] <= 2 * 3 * 2 < cut[16]
    for bad in (0, -3, 2.5, "64"):
        with pytest.raises(ValueError, match="max_span"):
            jacap_attn.JacapConfig(max_span=bad)


def test_words_without_a_vocabulary_warn_once_per_model():
    """Jacap's default keeps words whole; a model without a tokenizer (none given, none in its folder
    or the local Hugging Face cache) ranks token by token, and ``patch`` says so, once."""
    import warnings

    model = tiny_model("llama")
    with pytest.warns(UserWarning, match="spans='words'.*ranking token by token"):
        jacap_attn.patch(model, ratio=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jacap_attn.patch(model, ratio=0.2)  # the same model: said once
        other = tiny_model("llama")
        jacap_attn.patch(other, ratio=0.3, spans="none")  # asked for none: nothing to say
        jacap_attn.patch(tiny_model("llama"), ratio=0.3, tokenizer=WordTokenizer())
    jacap_attn.unpatch(model)
    jacap_attn.unpatch(other)
    # clause and sentence units read the vocabulary too: once they fell back to none without a word
    with pytest.warns(UserWarning, match=r"units='sentences' needs the model's vocabulary.*token by token"):
        jacap_attn.patch(tiny_model("llama"), ratio=0.3, spans="none", units="sentences")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jacap_attn.patch(tiny_model("llama"), ratio=0.3, spans="none", units="chunks")  # fixed-length: no vocabulary


def test_a_config_saved_before_spans_existed_reads_as_token_by_token():
    """A file answers with the settings it was saved with: a config written before ``spans`` (or
    ``max_span``) existed reads as the behaviour of its time, not as today's default."""
    saved = jacap_attn.JacapConfig().to_dict()
    assert jacap_attn.JacapConfig.from_dict(saved) == jacap_attn.JacapConfig()
    before_spans = {k: v for k, v in saved.items() if k not in ("spans", "max_span")}
    assert jacap_attn.JacapConfig.from_dict(before_spans).spans == "none"
    before_cap = {k: v for k, v in saved.items() if k != "max_span"}
    config = jacap_attn.JacapConfig.from_dict(before_cap)
    assert (config.spans, config.max_span) == ("words", 16)


def test_a_document_loaded_into_an_unpatched_model_takes_a_tokenizer(tmp_path):
    """``Document.load(path, model, tokenizer=...)`` (and ``load_cache``) hand the tokenizer to the patch they
    make on an unpatched model built in memory (no folder to find one in): its word spans are on, and the
    loaded document answers as the one in memory; without it the spans are off (token by token)."""
    ids, question = _word_ids(120, seed=3), _word_ids(6, seed=4)
    model = jacap_attn.patch(tiny_model("llama"), ratio=1.0, reselect=0.25, window=8, tokenizer=WordTokenizer(),
                             spans="words", min_tokens=0)
    doc = jacap_attn.Document.compress(model, ids)
    want = doc.generate(question, max_new_tokens=6, do_sample=False)
    path = tmp_path / "doc.safetensors"
    doc.save(path, quantize=None)
    fresh = tiny_model("llama")
    loaded = jacap_attn.Document.load(path, fresh, tokenizer=WordTokenizer())
    assert fresh._jacap_state.spans is not None
    assert torch.equal(loaded.generate(question, max_new_tokens=6, do_sample=False), want)
    other = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        jacap_attn.Document.load(path, other)
    assert other._jacap_state.spans is None

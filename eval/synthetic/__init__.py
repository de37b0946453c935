"""Seeded synthetic long-context tasks in the style of RULER, with real prose haystacks.

Every task hides one or more short *needles* (facts) in a long document made of real English
prose and asks a question whose answer is only in the needles. The prose corpus, the document
builder (length targeting, tokenizer protocol) and the prompt layout are the library's
(:mod:`jacap_attn.prose`, :mod:`jacap_attn.prompts`, re-exported here); this package holds the
tasks, their samples and the scorer:

* :mod:`eval.synthetic.samples`: :class:`Sample`, :class:`ApproxTokenizer`, the corpus
  fingerprint and the shared sample driver;
* :mod:`eval.synthetic.generators`: the task generators, :data:`TASKS` and :func:`generate`;
* :mod:`eval.synthetic.prompts`: :func:`format_choices`, :func:`split_prompt`, :func:`score` and
  :func:`passkey_prompt`.

Tasks (see :data:`TASKS`)
-------------------------
``single_needle``
    Passkey retrieval: one "The special magic number for <key> is: <7 digits>." needle.
``multikey_needle``
    Several magic-number needles with different keys; the question asks for one key's number.
``multivalue_needle``
    One key with several numbers scattered over the document; all of them are asked for.
``variable_tracking``
    Chains ``VAR A = 12345.``, ``VAR B = A.`` ... (plus a distractor chain); which variables
    hold the value?
``kv_retrieval``
    A JSON object of many short UUID-like key/value pairs embedded in the prose; the value of one
    key is asked for.
``multiple_choice``
    A few facts of different kinds ("The archive of <city> is kept in the <color> tower.",
    ...) and a four-way multiple-choice question about one of them, for loglikelihood scoring
    (``same_kind=True``: all facts of one kind, every option stated in the document).

Length targeting
----------------
``context_tokens`` is the length, in tokens of the given tokenizer, of :attr:`Sample.context`
(the document with its needles, without the prompt's instruction, question or chat template,
which add about 30-80 tokens); see :mod:`jacap_attn.prose`. Chat formatting (``chat=True``)
additionally calls ``tokenizer.apply_chat_template(messages, tokenize=False,
add_generation_prompt=True)``.

Determinism
-----------
Sample ``i`` of a task depends only on ``(task, seed, i)`` (its own ``random.Random`` seeded with
a string, which Python hashes with SHA-512, so ``PYTHONHASHSEED`` does not matter), on the
tokenizer and on the prose corpus. The corpus is the ``pydoc_data`` of the running Python, which
changes between Python versions: the same seed gives the same samples on the same Python
version; :data:`CORPUS_FINGERPRINT` (stored in every sample's ``meta``) identifies the corpus.
Generated data sets should be kept as files (see ``eval/make_tasks.py``) rather than regenerated
on another interpreter.
"""

from jacap_attn.prompts import (
    PREAMBLE,
    QUESTION_LABEL,
    DemoDoc,
    demo_document,
    format_prompt,
    format_question,
    is_token_prefix,
)
from jacap_attn.prose import count_tokens, haystack_paragraphs

from .generators import (
    GENERATE_TASKS,
    TASKS,
    generate,
    kv_retrieval,
    multikey_needle,
    multiple_choice,
    multivalue_needle,
    single_needle,
    variable_tracking,
)
from .prompts import format_choices, passkey_prompt, score, split_prompt
from .samples import CORPUS_FINGERPRINT, ApproxTokenizer, Sample

__all__ = [
    "Sample",
    "DemoDoc",
    "TASKS",
    "GENERATE_TASKS",
    "PREAMBLE",
    "QUESTION_LABEL",
    "CORPUS_FINGERPRINT",
    "ApproxTokenizer",
    "single_needle",
    "multikey_needle",
    "multivalue_needle",
    "variable_tracking",
    "kv_retrieval",
    "multiple_choice",
    "generate",
    "format_prompt",
    "format_question",
    "format_choices",
    "split_prompt",
    "is_token_prefix",
    "score",
    "passkey_prompt",
    "demo_document",
    "haystack_paragraphs",
    "count_tokens",
]

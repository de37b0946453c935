"""Integrations of jacap_attn with evaluation frameworks.

* :mod:`jacap_attn.integrations.lm_eval`: the ``hf-jacap`` model type of EleutherAI's
  lm-evaluation-harness (needs the ``eval`` extra). Importing it registers the model with lm-eval.

This package imports no framework itself: each integration imports its framework when it is imported.
"""

LM_EVAL_MODEL_NAME = "hf-jacap"
LM_EVAL_MODEL_TARGET = "jacap_attn.integrations.lm_eval:JacapLM"


def register_lm_eval_model() -> None:
    """Make ``hf-jacap`` known to lm-eval's model registry as a lazy entry: the model class (and
    torch) is imported only when an evaluation asks for ``hf-jacap``.

    lm-eval 0.4.13 fills its registry by importing ``lm_eval.models`` only while the registry is
    empty, so that package is imported first. A no-op when the name is already registered.
    """
    import lm_eval.models  # noqa: F401
    from lm_eval.api.registry import model_registry

    if LM_EVAL_MODEL_NAME not in model_registry:
        model_registry.register(LM_EVAL_MODEL_NAME, target=LM_EVAL_MODEL_TARGET)


__all__ = ["LM_EVAL_MODEL_NAME", "LM_EVAL_MODEL_TARGET", "register_lm_eval_model"]

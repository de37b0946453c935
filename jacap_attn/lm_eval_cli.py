"""lm-eval's own command line with the ``hf-jacap`` model registered.

    python -m jacap_attn.lm_eval_cli --model hf-jacap --model_args pretrained=<folder>,ratio=0.1 ...

The stock ``lm_eval`` command finds ``hf-jacap`` and the shipped tasks by itself once jacap-attn is
installed (an import hook registers them when lm-eval loads its model registry and its task manager).
This entry point does the same registration explicitly, for installs where that hook does not run (``pip install --target``,
``python -S``, a zip application).
"""

from __future__ import annotations

import sys


def main() -> int | None:
    """Register ``hf-jacap`` and the shipped tasks (:mod:`jacap_attn.tasks`), then run ``lm_eval``'s
    ``cli_evaluate`` on ``sys.argv``."""
    import lm_eval.tasks.manager
    from lm_eval.__main__ import cli_evaluate

    from _jacap_attn_lm_eval import register_tasks
    from jacap_attn.integrations import register_lm_eval_model

    register_lm_eval_model()
    register_tasks(lm_eval.tasks.manager)
    return cli_evaluate()


if __name__ == "__main__":
    sys.exit(main())

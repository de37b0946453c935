"""lm-eval's own command line with the ``hf-jacap`` model registered.

    python -m jacap_attn.lm_eval_cli --model hf-jacap --model_args pretrained=<folder>,ratio=0.1 ...

The stock ``lm_eval`` command finds ``hf-jacap`` by itself once jacap-attn is installed (an import
hook registers it when lm-eval loads its model registry). This entry point does the same
registration explicitly, for installs where that hook does not run (``pip install --target``,
``python -S``, a zip application).
"""

from __future__ import annotations

import sys


def main() -> int | None:
    """Register ``hf-jacap``, then run ``lm_eval``'s ``cli_evaluate`` on ``sys.argv``."""
    from lm_eval.__main__ import cli_evaluate

    from jacap_attn.integrations import register_lm_eval_model

    register_lm_eval_model()
    return cli_evaluate()


if __name__ == "__main__":
    sys.exit(main())

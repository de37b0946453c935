"""Evaluation tooling for jacap_attn: synthetic long-context task data and lm-eval task configs.

Run ``python -m eval.make_tasks --help`` to generate data; the lm-evaluation-harness task YAMLs
live in ``eval/tasks`` (see ``eval/tasks/README.md``).
"""

"""Evaluation of jacap_attn, run from a checkout (not installed with the package; see eval/README.md).

``python -m eval.speed`` (speed benchmark), ``python -m eval.quality`` (quality harness, tables and
plots by :mod:`eval.quality_report`), :mod:`eval.synthetic` (RULER-style task generators),
``python -m eval.make_tasks`` (task data and the lm-evaluation-harness YAMLs of ``eval/tasks``),
:mod:`eval.kvpress` (kvpress side by side).
"""

"""Data files of the lm-eval task (read by path, :mod:`jacap_attn.tasks`): a package so that the wheel ships them."""

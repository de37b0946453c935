"""The library's version, in one place: read statically by setuptools (pyproject.toml's
``[tool.setuptools.dynamic]``) and re-exported as ``jacap_attn.__version__``. Imports nothing."""

__version__ = "0.1.0"

"""Build hook (everything else is in pyproject.toml): ship ``jacap_attn_lm_eval.pth`` at the top of
site-packages, in wheels and in editable installs. Its one line imports ``_jacap_attn_lm_eval``, the
start-up hook that lets the stock ``lm_eval`` command (lm-eval 0.4.13) find ``hf-jacap``."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "jacap_attn_lm_eval.pth"
PTH_LINE = "import _jacap_attn_lm_eval\n"


class build_py_with_pth(build_py):
    """``build_py`` that also writes the ``.pth`` file at the root of the wheel."""

    def run(self):
        super().run()
        # A wheel is built from build_lib; an editable wheel (setuptools >= 64) only keeps what is
        # written to the install dir, which `editable_wheel` points at the unpacked wheel.
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, PTH_NAME), "w", encoding="utf-8") as handle:
            handle.write(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, os.path.join(self.build_lib, PTH_NAME)]


setup(cmdclass={"build_py": build_py_with_pth})

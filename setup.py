"""Build hooks (everything else is in pyproject.toml):

* ship ``jacap_attn_lm_eval.pth`` at the top of site-packages, in wheels and in editable installs.
  Its one line imports ``_jacap_attn_lm_eval``, the start-up hook that lets the stock ``lm_eval``
  command (lm-eval 0.4.13) find ``hf-jacap``;
* add the packages that pyproject.toml's ``package-dir`` maps to folders of their own (the top-level
  ``patches/`` folder is ``jacap_attn.patches``), with their subpackages, to the packages that its
  ``[tool.setuptools.packages.find]`` found: ``find`` only sees folders named like their package.
"""

import os

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

PTH_NAME = "jacap_attn_lm_eval.pth"
PTH_LINE = "import _jacap_attn_lm_eval\n"


def mapped_packages(package_dir: dict) -> list[str]:
    """Every package under a folder that ``package_dir`` maps to a package name (``""``, the root of
    the found packages, excepted): the mapped package and each subpackage in its folder."""
    found = []
    for name, folder in package_dir.items():
        if name:
            found += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return found


class DistributionWithMappedPackages(Distribution):
    """``Distribution`` whose packages also hold the :func:`mapped_packages` once pyproject.toml is read."""

    def parse_config_files(self, *args, **kwargs):
        super().parse_config_files(*args, **kwargs)
        packages = list(self.packages or [])
        self.packages = packages + [p for p in mapped_packages(self.package_dir or {}) if p not in packages]


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


setup(distclass=DistributionWithMappedPackages, cmdclass={"build_py": build_py_with_pth})

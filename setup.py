"""Build hook: the wheel ships shared_specs/ (the one copy, in the repository's root) as
ampkit/shared_specs. Everything else is in pyproject.toml.

A build step rather than a package-dir mapping: a mapped folder outside python/ turns
editable installs into an import hook that a folder named ``ampkit`` in the working
directory (the R package's, under r/) shadows; this way an editable install stays a plain
path entry, and ampkit._specs finds the specs in the checkout.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SPECS = Path(__file__).resolve().parent / "shared_specs"
PATTERNS = ("policies/*.yaml", "benchmarks/*.yaml", "benchmarks/*.json", "benchmarks/variants/*.yaml")


class build_py_with_specs(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads the checkout's shared_specs
        target = Path(self.build_lib) / "ampkit" / "shared_specs"
        for pattern in PATTERNS:
            for src in sorted(SPECS.glob(pattern)):
                dst = target / src.relative_to(SPECS)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)


setup(cmdclass={"build_py": build_py_with_specs})

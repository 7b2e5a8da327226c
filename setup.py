"""Which packages install: found, not listed, so a new subpackage cannot be left out of a wheel.

pyproject.toml holds everything else. tui/ and metal/ stay top-level folders
in the repository but install under the mlxkv namespace (its package-dir
mapping), so no top-level `tui` or `metal` lands in site-packages.
"""

from setuptools import find_packages, setup

MAPPED = ("tui", "metal")  # repository folders installed as mlxkv.<name>

packages = find_packages(include=["mlxkv", "mlxkv.*"])
packages += ["mlxkv." + name for name in find_packages(include=[f"{m}{s}" for m in MAPPED for s in ("", ".*")])]
setup(packages=packages)

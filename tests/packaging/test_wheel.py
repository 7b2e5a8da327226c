"""A wheel built from the checkout installs without `-e` and works from outside it.

CI installs the project editable, which hides a subpackage missing from the
wheel (mlxkv.cache.groups once was: `import mlxkv` failed in any real install).
Here the wheel goes into a fresh venv whose only view of the checkout is the
wheel; the dependencies come from this venv's site-packages (added as a path,
so its editable finder is not installed there).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

IMPORT_ALL = """
import importlib, pkgutil, sys
import mlxkv
assert "site-packages" in mlxkv.__file__, mlxkv.__file__
names = [m.name for m in pkgutil.walk_packages(mlxkv.__path__, "mlxkv.")]
for name in names:
    importlib.import_module(name)
import mlxkv.metal, mlxkv.tui
from importlib import resources
assert resources.files("mlxkv.metal").joinpath("paged_decode.metal").is_file()
assert resources.files("mlxkv.tui").joinpath("chat.tcss").is_file()
# The deps come from the dev venv: no module may import a dev-only package where it is imported
# (sentencepiece left out: transformers imports it whenever it is installed).
dev_only = {"pytest", "hypothesis", "xdist", "openai", "anthropic", "gguf", "jsonschema"}
assert not dev_only & set(sys.modules), sorted(dev_only & set(sys.modules))
print(len(names))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed; returns its python."""
    root = tmp_path_factory.mktemp("wheel")
    # From a copy without build leftovers: a stale build/lib or egg-info would hand the wheel what is missing.
    source = shutil.copytree(ROOT, root / "source", ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "-w", str(root / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel = next((root / "dist").glob("mlxkv-*.whl"))
    env_dir = root / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return python


def test_every_module_imports_from_the_wheel(installed, tmp_path):
    done = subprocess.run([str(installed), "-c", IMPORT_ALL], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 100  # every module, not an empty package


def test_generate_runs_from_the_wheel(installed, tmp_path):
    done = subprocess.run([str(installed.parent / "mlxkv"), "generate", "--model", "tiny", "--json",
                           "--max-tokens", "4", "--prompt", "Hello there"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "c")})
    assert done.returncode == 0, done.stderr
    assert '"text"' in done.stdout

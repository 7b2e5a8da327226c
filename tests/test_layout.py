"""The project's shape: small modules, a quiet import, nothing installed at the top level but mlxkv."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400


def test_no_module_is_over_400_lines():
    modules = [p for d in ("mlxkv", "tui") for p in (ROOT / d).rglob("*.py")]
    assert len(modules) > 50
    long = {str(p.relative_to(ROOT)): n for p in modules if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _python(code: str, **env) -> subprocess.CompletedProcess:
    # Run from outside the checkout, so only what is installed can be imported.
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(os.sep), env={**os.environ, **env})


@pytest.mark.slow
@pytest.mark.parametrize("blas", ["", "off", "/nonexistent/libnope.so"])
def test_import_mlxkv_prints_nothing(blas):
    done = _python("import mlxkv; from mlxkv import Engine, CacheConfig", MLXKV_BLAS=blas)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


@pytest.mark.slow
def test_only_mlxkv_is_installed_at_the_top_level():
    done = _python("import importlib.util as u, mlxkv.tui.app, mlxkv.metal; "
                   "print(u.find_spec('tui'), u.find_spec('metal'))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "None"]


@pytest.mark.slow
def test_the_kernel_sources_are_package_data_of_mlxkv():
    done = _python("from importlib import resources; "
                   "print(sorted(p.name for p in resources.files('mlxkv.metal').iterdir() if p.suffix == '.metal'))")
    assert done.stdout.strip() == "['common.metal', 'paged_decode.metal', 'paged_decode_multi.metal', 'paged_reduce.metal']"


def _imported_packages(package: str) -> dict[str, set[str]]:
    """For each module of mlxkv/<package>, the mlxkv packages it imports (at any depth of its code)."""
    import ast

    found = {}
    for path in (ROOT / "mlxkv" / package).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mlxkv."):
                names.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                names |= {a.name.split(".")[1] for a in node.names if a.name.startswith("mlxkv.")}
        found[str(path.relative_to(ROOT))] = names
    return found


def test_the_cache_imports_nothing_above_it():
    """The connector protocol is the cache's seam: the tiers implement it, the cache never imports them."""
    above = {"connectors", "attention", "engine", "chat", "models", "host", "server", "tui", "benchmarks", "cli"}
    imports = _imported_packages("cache")
    assert len(imports) > 10
    assert {module: names & above for module, names in imports.items() if names & above} == {}


def test_the_engine_host_knows_nothing_of_http():
    """mlxkv/host serves the chat app and the server alike: it imports neither."""
    sources = {p.name: p.read_text() for p in (ROOT / "mlxkv" / "host").glob("*.py")}
    assert {"engine_thread.py", "request_handle.py", "pool_view.py"} <= set(sources)
    assert [name for name, text in sources.items()
            if any(word in text for word in ("mlxkv.server", "starlette", "uvicorn", "mlxkv.tui"))] == []
    assert not (ROOT / "mlxkv" / "serving").exists()


FORBIDDEN_INSIDE_THE_CORE = ("mlxkv.engine.loop", "mlxkv.engine.model_runner", "mlxkv.cache.coordinator")
# EngineCore's parts, reached as attributes rather than imports (`core.coordinator.recurrent`).
CORE_PARTS = ("coordinator", "runner", "kv_pool")


def _imported_modules(path: Path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def _reached_parts(path: Path) -> set[str]:
    import ast

    return {node.attr for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in CORE_PARTS}


def test_the_engines_callers_use_only_the_cores_surface():
    """host/, server/, speculative/ and the chat app reach the batch loop, the model runner and
    the cache coordinator only through EngineCore (engine/core.py), never by importing them
    or by reading the core's parts."""
    files = [p for d in ("mlxkv/host", "mlxkv/server", "mlxkv/speculative", "tui") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 20
    reaching = {str(p.relative_to(ROOT)): sorted(m for m in _imported_modules(p)
                                                 if m.startswith(FORBIDDEN_INSIDE_THE_CORE))
                for p in files}
    assert {path: names for path, names in reaching.items() if names} == {}
    parts = {str(p.relative_to(ROOT)): sorted(_reached_parts(p)) for p in files}
    assert {path: names for path, names in parts.items() if names} == {}


def test_config_imports_nothing_above_it():
    """config.py sits at the bottom with the value types it holds: the cache, the tiers and
    the engine import it, never the other way round."""
    bottom = {"mlxkv.errors", "mlxkv.kv_format", "mlxkv.remote_url"}
    for name in ("config.py", "kv_format.py", "remote_url.py", "errors.py"):
        modules = {m for m in _imported_modules(ROOT / "mlxkv" / name) if m.startswith("mlxkv.")}
        above = {m for m in modules if not any(m == b or m.startswith(b + ".") for b in bottom)}
        assert (name, above) == (name, set())


MAX_METHODS = 16


def _methods(cls) -> int:
    """Functions defined in a class body; a property reads as an attribute, so it does not count."""
    import ast

    fns = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return sum(1 for f in fns if not any(getattr(d, "id", None) == "property" for d in f.decorator_list))


def test_no_class_in_the_cache_has_more_than_16_methods():
    import ast

    counts = {}
    for path in (ROOT / "mlxkv" / "cache").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                counts[f"{path.relative_to(ROOT)}:{node.name}"] = _methods(node)
    assert len(counts) > 20 and counts["mlxkv/cache/coordinator.py:KVCacheCoordinator"] > 10
    assert {name: n for name, n in counts.items() if n > MAX_METHODS} == {}


def test_a_request_is_the_one_writer_of_its_stats_and_issued():
    """Only engine/request.py assigns a RequestStats field or Request.issued; the scheduler,
    the postprocess and the speculation hand it what they computed."""
    import ast
    import dataclasses

    from mlxkv.engine.records import RequestStats

    owned = {f.name for f in dataclasses.fields(RequestStats)} | {"issued", "output"}
    writers = {}
    for d in ("engine", "speculative", "host"):
        for path in (ROOT / "mlxkv" / d).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                targets = node.targets if isinstance(node, ast.Assign) else (
                    [node.target] if isinstance(node, ast.AugAssign) else [])
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr in owned:
                        writers.setdefault(str(path.relative_to(ROOT)), set()).add(t.attr)
    assert set(writers) == {"mlxkv/engine/request.py"}, writers


def design_layers() -> list[set[str]]:
    """docs/design.md's numbered list of layers, lowest first: the packages each item names in
    backticks. A package imports only its own layer and those below, but for RUNNING_UP."""
    import re

    text = (ROOT / "docs" / "design.md").read_text().split("Dependencies point down these layers", 1)[1]
    items = re.split(r"\n\d+\. ", "\n" + text.split("\n\n", 2)[1])[1:]
    return [set(re.findall(r"`(\w+)`", item)) for item in items]


RUNNING_UP = {("models", "vision"), ("models", "engine"), ("engine", "distributed"), ("distributed", "server")}


def _package_imports() -> set[tuple[str, str]]:
    """(importer, imported) between mlxkv's top-level packages and modules."""
    edges = set()
    for path in (ROOT / "mlxkv").rglob("*.py"):
        parts = path.relative_to(ROOT / "mlxkv").parts
        source = parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")
        for module in _imported_modules(path):
            names = module.split(".")
            if names[0] == "mlxkv" and len(names) > 1 and names[1] != source and names[1] != "__init__":
                edges.add((source, names[1]))
    return edges


def test_imports_point_down_the_layers_design_md_lists():
    layers = design_layers()
    assert len(layers) == 10 and {"cache"} in layers and "server" in layers[8]
    layer = {name: i for i, names in enumerate(layers) for name in names}
    edges = {(a, b) for a, b in _package_imports() if a in layer and b in layer}
    assert {(a, b) for a, b in edges if layer[b] > layer[a]} == RUNNING_UP
    assert len(edges) > 40 and set(layer) >= {a for a, _ in _package_imports() if a != "__init__"}
    design = (ROOT / "docs" / "design.md").read_text()
    for a, b in RUNNING_UP:
        assert f"`{a}` -> `{b}`" in design


def test_design_md_names_every_package_and_module():
    """The package table has a row for every package of mlxkv/, naming each of its modules
    (or a pattern such as `gguf*.py` that covers it)."""
    import fnmatch
    import re

    design = (ROOT / "docs" / "design.md").read_text()
    rows = {m.group(1): line for line in design.splitlines() if (m := re.match(r"\| `mlxkv/(\w+)/` \|", line))}
    packages = [p for p in (ROOT / "mlxkv").iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert len(packages) > 10 and sorted(p.name for p in packages if p.name not in rows) == []
    for package in packages:
        named = re.findall(r"`([\w*/.]+)`", rows[package.name])
        unnamed = [f.name for f in package.glob("*.py") if f.name != "__init__.py"
                   and not any(fnmatch.fnmatch(f.name, n) or n == f.stem for n in named)]
        subpackages = [d.name for d in package.iterdir() if (d / "__init__.py").exists() and f"{d.name}/" not in named]
        assert (package.name, unnamed, subpackages) == (package.name, [], [])

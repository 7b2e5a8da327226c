"""`mlxkv serve`'s flags for several models, merged with a --models file (flags win, their aliases first)."""

import re
import shlex
from pathlib import Path

import pytest

from mlxkv.cli import build_parser, served_models
from mlxkv.kv_format import KVFormat
from mlxkv.server.model_names import ModelNames
from mlxkv.server.model_specs import NEVER, ModelSpec

DOCS = Path(__file__).resolve().parents[2] / "docs"


def parse(*argv):
    return served_models(build_parser().parse_args(["serve", *argv]))


def test_flags_and_file_merge(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text('max_loaded = 3\nkeep_alive = "-1"\n[models.coder]\nsource = "/m/coder"\npin = true\n'
                    '[aliases]\n"claude-*" = "coder"\n')
    specs, models = parse("--models", str(path), "--model", "small=tiny", "--alias", "claude-haiku-*=small",
                          "--max-loaded", "1", "--memory-budget", "2GB")
    assert specs == [ModelSpec("coder", "/m/coder", pin=True), ModelSpec("small", "tiny")]
    assert models.aliases == [("claude-haiku-*", "small"), ("claude-*", "coder")]
    assert (models.max_loaded, models.memory_budget, models.keep_alive_s) == (1, 2 << 30, NEVER)
    assert parse("--keep-alive", "0")[1].keep_alive_s == 0
    specs, models = parse()
    assert specs == [ModelSpec("demo", "demo")] and models.keep_alive(1) == NEVER and models.keep_alive(2) == 300


@pytest.mark.parametrize("argv, message", [
    (["--keep-alive", "soon"], "argument --keep-alive: expected a duration"),
    (["--memory-budget", "lots"], "argument --memory-budget: expected a size"),
    (["--max-loaded", "0"], "argument --max-loaded: must be at least 1"),
])
def test_bad_flags_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err


def fenced(text: str, after: str, language: str) -> str:
    """The first ```language block after the line `after`."""
    return re.search(rf"```{language}\n(.*?)```", text[text.index(after):], re.S).group(1)


def test_the_docs_models_file_and_two_model_claude_code_setup_are_what_serve_takes(tmp_path):
    """docs/server.md's --models file and docs/agents.md's command parse as they say, and
    Claude Code's two names reach the two models."""
    path = tmp_path / "models.toml"
    path.write_text(fenced((DOCS / "server.md").read_text(), "**The file.**", "toml"))
    specs, models = parse("--models", str(path))
    assert [(s.name, s.pin, s.kv_format, s.context) for s in specs] == [("coder", True, KVFormat(bits=8), None),
                                                                        ("small", False, None, 32768)]
    assert (models.max_loaded, models.keep_alive_s) == (2, 600)
    shell = fenced((DOCS / "agents.md").read_text(), "### A big model and a small one", "sh")
    argv = shlex.split(shell.replace("\\\n", " ").splitlines()[0])
    assert argv[:2] == ["mlxkv", "serve"]
    specs, models = parse(*argv[2:])
    assert [s.name for s in specs] == ["coder", "small"]
    names = ModelNames([s.name for s in specs], models.aliases, models.default_model)
    assert (names.resolve("claude-haiku-4-5"), names.resolve("claude-sonnet-4-5")) == ("small", "coder")

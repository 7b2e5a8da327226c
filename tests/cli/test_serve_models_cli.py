"""`mlxkv serve`'s flags for several models, merged with a --models file (flags win, their aliases first)."""

import pytest

from mlxkv.cli import build_parser, served_models
from mlxkv.server.model_specs import NEVER, ModelSpec


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

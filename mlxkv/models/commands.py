"""`mlxkv models list | pull ID | rm NAME`: the command line over catalog.py, fetch.py and removal.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mlxkv.errors import MlxkvError

COLUMNS = ("NAME", "FAMILY", "QUANT", "SIZE", "CONTEXT", "SERVED", "FROM")


def add_models_parser(sub) -> None:
    p = sub.add_parser("models", help="list, download or remove models")
    p.set_defaults(func=run)
    actions = p.add_subparsers(dest="action", required=True, metavar="{list,pull,rm}")
    listing = actions.add_parser("list", help="every model runnable here, by the name --model takes")
    listing.add_argument("--json", action="store_true", help="one JSON object per model")
    pull = actions.add_parser("pull", help="download a Hugging Face model, with progress")
    pull.add_argument("id", help="a Hugging Face id, e.g. mlx-community/Qwen2.5-0.5B-Instruct-4bit")
    rm = actions.add_parser("rm", help="remove a model and its SSD-tier blocks, after asking")
    rm.add_argument("name", help="a name `mlxkv models list` shows")
    rm.add_argument("--yes", action="store_true", help="do not ask (for scripts)")
    rm.add_argument("--disk-tier", default=None, metavar="DIR", help="SSD tier directory (default: the user cache dir)")


def run(args) -> int:
    return {"list": list_models, "pull": pull_model, "rm": remove_model}[args.action](args)


def list_models(args) -> int:
    from mlxkv.models.catalog import scan

    entries = scan()
    if args.json:
        for entry in entries:
            print(json.dumps(entry.as_json()))
        return 0
    rows = [COLUMNS] + [(e.name, e.family, e.quantization, _size(e.size), str(e.context or "?"), e.served, e.source)
                        for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    return 0


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB" if n else "-"


def pull_model(args) -> int:
    from mlxkv.models import fetch

    kind, _ = fetch.resolve(args.id)
    if kind != "hf":
        raise MlxkvError(f"{args.id} is already here; `mlxkv models pull` downloads Hugging Face ids")
    cached = fetch.cached(args.id)
    if cached:
        print(f"{args.id} is already downloaded: {cached}")
        return 0
    progress = ProgressLine(sys.stderr)
    path = fetch.download(args.id, progress)
    progress.done()
    print(path)
    return 0


class ProgressLine:
    """A fetch.Report that redraws one line on a terminal, and writes a line per tenth elsewhere."""

    def __init__(self, stream):
        self.stream, self.tenths = stream, -1
        self.live = stream.isatty()

    def __call__(self, text: str, fraction: float | None) -> None:
        if self.live:
            self.stream.write(f"\r\033[K{text}")
        elif fraction is None or int(fraction * 10) > self.tenths:
            self.tenths = -1 if fraction is None else int(fraction * 10)
            self.stream.write(f"{text}\n")
        self.stream.flush()

    def done(self) -> None:
        if self.live:
            self.stream.write("\n")


def remove_model(args) -> int:
    from mlxkv.models.removal import plan
    from mlxkv.system.paths import default_disk_tier_dir

    removal = plan(args.name, Path(args.disk_tier or default_disk_tier_dir()).expanduser())
    lines = removal.lines()
    if removal.kept:
        print(removal.kept)
    if not lines:
        print(f"mlxkv holds nothing of {removal.entry.name} to remove")
        return 0
    if not args.yes:
        if not sys.stdin.isatty():
            raise MlxkvError("mlxkv models rm asks before it deletes: run it in a terminal, or add --yes")
        print(f"This removes {removal.entry.name}:", *lines, sep="\n")
        if input("Remove? [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    removal.remove()
    print(f"removed {removal.entry.name}:", *lines, sep="\n")
    return 0

"""Flags several commands share: checked numbers, and the cache flags that make a CacheConfig."""

from __future__ import annotations

import argparse
import math
import os

from mlxkv import config as defaults

REMOTE_TIER_ENV = "MLXKV_REMOTE_TIER"
REMOTE_TIER_SALT_ENV = "MLXKV_REMOTE_TIER_SALT"


def number(kind: type, low: float, high: float | None = None):
    """An argparse type: an int or a finite float from `low` (to `high`), or
    argparse's one-line error naming the flag."""
    if high is not None:
        wanted = f"between {low} and {high}"
    else:
        wanted = f"at least {low}" if low > 0 else f"{low} or more"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'a whole number' if kind is int else 'a number'}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if not (low <= value and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    return parse


def add_cache_flags(p: argparse.ArgumentParser, model_help: str | None = None, *, many_models: bool = False) -> None:
    if many_models:  # mlxkv serve: --model [NAME=]SOURCE, repeated
        p.add_argument("--model", action="append", default=None, metavar="[NAME=]SOURCE", help=model_help)
    else:
        p.add_argument("--model", default="demo" if model_help is None else None,
                       help=model_help or 'model directory, GGUF file, Hugging Face id, "demo" (default) or "tiny"')
    p.add_argument("--block-size", type=int, default=defaults.DEFAULT_BLOCK_SIZE, help="tokens per KV block (power of two)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (default: a share of memory)")
    p.add_argument("--no-prefix-cache", action="store_true", help="do not share blocks between prompts")
    p.add_argument("--kv-bits", type=int, default=None, choices=[8, 4],
                   help="store K/V quantized in the pool and its tiers (default: the model's dtype)")
    p.add_argument("--kv-group-size", type=int, default=None, choices=[64, 32],
                   help=f"values per scale and bias of a quantized pool (with --kv-bits; default "
                        f"{defaults.DEFAULT_KV_GROUP_SIZE})")
    p.add_argument("--memory-tier-mb", type=number(int, 0), default=defaults.DEFAULT_MEMORY_TIER_BYTES >> 20, help="unified-memory tier budget (0 turns it off)")
    p.add_argument("--memory-tier-bits", type=int, default=None, choices=[4, 8], help="quantize memory-tier blocks")
    p.add_argument("--disk-tier", default=None, metavar="DIR", help="SSD tier directory (persists across runs)")
    p.add_argument("--disk-tier-mb", type=number(int, 1), default=None, help="SSD tier budget")
    p.add_argument("--disk-tier-min-free-mb", type=number(int, 0), default=None,
                   help="free space the SSD tier leaves on its disk (default: 5%% of the disk, at most 1024)")
    p.add_argument("--no-disk-tier", action="store_true", help="turn the SSD tier off")
    add_remote_tier_flags(p)
    p.add_argument("--speculative", choices=["lookup", "draft"], default=None,
                   help="speculative decoding: proposals from the prompt (lookup) or a draft model")
    p.add_argument("--draft-model", default=None, metavar="PATH_OR_ID", help="the draft model for --speculative draft")
    p.add_argument("--speculative-tokens", type=number(int, 1, defaults.MAX_SPECULATIVE_TOKENS),
                   default=defaults.DEFAULT_SPECULATIVE_TOKENS, help="most tokens proposed per step")


def add_remote_tier_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--remote-tier", default=os.environ.get(REMOTE_TIER_ENV), metavar="URL",
                   help="a Redis or Valkey server many machines share: redis://[user:password@]host:port/db, "
                        f"rediss:// for TLS (default: ${REMOTE_TIER_ENV})")
    p.add_argument("--remote-tier-salt", default=os.environ.get(REMOTE_TIER_SALT_ENV), metavar="SECRET",
                   help="only engines with this secret share blocks (default: "
                        f"${REMOTE_TIER_SALT_ENV}; the variable keeps it out of the process list)")
    p.add_argument("--remote-tier-prefix", default=defaults.DEFAULT_REMOTE_TIER_PREFIX, metavar="PREFIX", help="key prefix on the server")
    p.add_argument("--remote-tier-ttl", type=number(int, 1), default=None, metavar="SECONDS",
                   help="keys expire this long after they are written (default: never; the server's LRU evicts)")
    p.add_argument("--remote-tier-timeout-ms", type=number(float, 1, 60000),
                   default=defaults.DEFAULT_REMOTE_TIER_TIMEOUT_MS, metavar="MS",
                   help="the longest a read waits on the server before it is a miss (default %(default)g)")
    p.add_argument("--no-remote-tier", action="store_true", help="turn the remote tier off")


def kv_format(args):
    """The pool's format from --kv-bits and --kv-group-size: a KVFormat from here to the kernel."""
    from mlxkv.errors import MlxkvError
    from mlxkv.kv_format import KVFormat

    bits, group = getattr(args, "kv_bits", None), getattr(args, "kv_group_size", None)
    if bits is None and group is not None:  # else a full-precision pool, the flag silently ignored
        raise MlxkvError(f"--kv-group-size {group} sets a quantized pool's groups: add --kv-bits 8 or 4")
    try:
        return KVFormat(bits, defaults.DEFAULT_KV_GROUP_SIZE if group is None else group)
    except MlxkvError as e:  # argparse's choices make this unreachable from the command line
        raise argparse.ArgumentTypeError(str(e)) from None


def cache_config(args):
    from mlxkv.config import CacheConfig

    mb = lambda n: None if n is None else n << 20  # noqa: E731
    return CacheConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        prefix_cache=not args.no_prefix_cache,
        kv_format=kv_format(args),
        memory_tier_bytes=args.memory_tier_mb << 20,
        memory_tier_bits=args.memory_tier_bits,
        disk_tier=None if args.no_disk_tier else args.disk_tier,
        disk_tier_bytes=mb(args.disk_tier_mb),
        disk_tier_min_free_bytes=mb(args.disk_tier_min_free_mb),
        remote_tier=None if args.no_remote_tier else args.remote_tier,
        remote_tier_salt=args.remote_tier_salt,
        remote_tier_prefix=args.remote_tier_prefix,
        remote_tier_ttl_s=args.remote_tier_ttl,
        remote_tier_timeout_ms=args.remote_tier_timeout_ms,
        speculative=args.speculative, draft_model=args.draft_model, speculative_tokens=args.speculative_tokens,
    )


def persistent_cache_config(args):
    """The cache flags, with the SSD tier on in the user cache dir unless turned off:
    chats and clients come back, so their KV should be there too."""
    from mlxkv.system.paths import default_disk_tier_dir

    config = cache_config(args)
    if not args.no_disk_tier and args.disk_tier is None:
        config.disk_tier = str(default_disk_tier_dir())
    return config


def add_models_flags(p: argparse.ArgumentParser) -> None:
    """mlxkv serve's flags for several models (docs/server.md, "Several models")."""
    p.add_argument("--models", default=None, metavar="FILE",
                   help="a TOML file of models, their options and aliases (docs/server.md)")
    p.add_argument("--alias", action="append", default=[], metavar="PATTERN=NAME",
                   help="serve request model names matching the shell pattern with model NAME, "
                        "e.g. 'claude-haiku-*=small' (repeat; the first match wins, exact names first)")
    p.add_argument("--default-model", default=None, metavar="NAME",
                   help="serve names that match no model or alias with NAME (default: 404; one model: it)")
    p.add_argument("--max-loaded", type=number(int, 1), default=None, metavar="N",
                   help="models loaded at once; the least recently used idle one is unloaded first")
    p.add_argument("--memory-budget", type=_checked(models_value("size")), default=None, metavar="SIZE",
                   help="bytes of weights plus KV pools the loaded models may take, e.g. 24GB")
    p.add_argument("--keep-alive", type=_checked(models_value("duration")), default=None, metavar="DURATION",
                   help="unload a model idle this long: 30s, 5m (default with several models), 0 at once, "
                        "-1 never (default with one)")


def models_value(kind: str):
    from mlxkv.server import model_specs

    return getattr(model_specs, kind)


def _checked(parse):
    """An argparse type from a parser raising MlxkvError: argparse's one-line error."""
    from mlxkv.errors import MlxkvError

    def run(text: str):
        try:
            return parse(text)
        except MlxkvError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return run

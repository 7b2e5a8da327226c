"""The `mlxkv` command line.

Importing this module imports the `mlxkv` package first, which loads the
real BLAS before anything imports mlx.core (see blas.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

from mlxkv.cli_flags import (REMOTE_TIER_ENV, add_cache_flags, add_models_flags, cache_config, kv_format, number,
                             persistent_cache_config)
from mlxkv.errors import MlxkvError, MlxkvWarning, warning_text


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate replies to one or more prompts")
    add_cache_flags(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt; repeat to run several in order")
    p.add_argument("--prompt-file", action="append", default=[], help="read a prompt from a file (- for stdin)")
    p.add_argument("--raw", action="store_true", help="send prompts as-is, without the chat template")
    p.add_argument("--max-tokens", type=number(int, 1), default=256)
    p.add_argument("--temp", type=number(float, 0), default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=number(float, 0, 1), default=0.0, help="nucleus sampling (0 = off)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--concurrent", action="store_true",
                   help="run the prompts as one batch (shared prefixes computed once), not in order")
    shape = p.add_mutually_exclusive_group()  # what the replies must match (docs/structured-output.md)
    shape.add_argument("--json-schema", metavar="FILE", help="replies are JSON valid against this schema file")
    shape.add_argument("--grammar", metavar="FILE", help="replies match this Lark grammar file (llguidance's Lark)")
    shape.add_argument("--regex", metavar="PATTERN", help="replies match this regular expression")
    _add_distributed_flags(p)
    p.set_defaults(func=cmd_generate)


def _add_chat(sub) -> None:
    from mlxkv.models.fetch import DEFAULT_CHAT_MODEL

    p = sub.add_parser("chat", help="chat in a terminal app with a live view of the KV cache")
    add_cache_flags(p, model_help=f'[NAME=]SOURCE: a model directory, GGUF file, Hugging Face id, or "demo" '
                                   f'(offline); repeat it to switch models from the command palette; default: '
                                   f'{DEFAULT_CHAT_MODEL}, downloaded once', many_models=True)
    p.add_argument("--max-tokens", type=number(int, 1), default=1024, help="longest reply")
    p.add_argument("--temp", type=number(float, 0), default=0.0, help="sampling temperature (0 = greedy)")
    p.set_defaults(func=cmd_chat)


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI- and Anthropic-compatible server on one shared KV pool")
    add_cache_flags(p, 'a model to serve: [NAME=]SOURCE, SOURCE a directory, GGUF file, Hugging Face id, '
                       '"demo" (default) or "tiny"; repeat it to serve several, loaded on demand',
                    many_models=True)
    add_models_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=number(int, 0, 65535), default=8000)
    p.add_argument("--api-key", default=None, help="require this key (default: $MLXKV_API_KEY, else none)")
    p.add_argument("--max-tokens", type=number(int, 1), default=2048, help="reply length when a request says none")
    p.add_argument("--temp", type=number(float, 0), default=0.0, help="temperature when a request says none")
    p.add_argument("--max-open", type=number(int, 1), default=256, help="requests queued or running before 429s")
    p.add_argument("--max-body-mb", type=number(int, 1), default=32, help="largest request body")
    p.add_argument("--reply-cap", type=number(int, 1), default=None,
                   help="cut every reply to at most this many tokens (agents ask for 32000)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="info: a start-up line and one line per request; debug: where each prompt "
                        "stopped matching the cache")
    p.add_argument("--quiet", action="store_true", help="warnings and errors only (same as --log-level warning)")
    p.add_argument("--max-image-pixels", type=number(int, 1), default=4096 * 4096,
                   help="largest image (width x height) a request may send; larger ones are a 400")
    p.add_argument("--max-images", type=number(int, 1), default=16, help="images one request may send")
    p.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs in requests (off: only base64 images are taken)")
    _add_distributed_flags(p)
    p.set_defaults(func=cmd_serve)


def _add_distributed_flags(p) -> None:
    from mlxkv.distributed.cluster import BACKENDS
    from mlxkv.distributed.sharding import KINDS

    p.add_argument("--distributed", choices=KINDS, default=None,
                   help="one model split over the ranks `mlx.launch` (or MLX_HOSTFILE and MLX_RANK) started: "
                        "every rank runs this command; rank 0 serves (docs/distributed.md)")
    p.add_argument("--distributed-backend", choices=BACKENDS, default="any",
                   help="MLX's transport between ranks: ring (TCP) or jaccl (Thunderbolt RDMA)")
    p.add_argument("--distributed-check", action="store_true",
                   help="every step, the ranks compare digests of their plans, tables and tokens, "
                        "and stop on a difference")


def _add_tiny_model(sub) -> None:
    from mlxkv.models.tiny import add_tiny_model_arguments

    p = sub.add_parser("tiny-model", help="write a random-weight model (no download)")
    add_tiny_model_arguments(p)
    p.set_defaults(func=cmd_tiny_model)


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side benchmark ratios")
    from mlxkv.benchmarks import SUITES  # the suites' modules load only when one runs

    p.add_argument("suite", nargs="?", default="engine", choices=[*SUITES, "all", "mac"],
                   help="a suite, all of them, or mac: the report of every ratio promised for Apple GPUs")
    p.add_argument("--report", metavar="FILE", default=None, help="mac: write FILE.json and FILE.md")
    p.add_argument("--context", type=number(int, 1), default=2048, help="context length for the engine benchmark")
    p.add_argument("--decode-tokens", type=number(int, 2), default=64)
    p.add_argument("--prefix", type=number(int, 0), default=1024, help="shared prefix length for the batch benchmark")
    p.add_argument("--efficiency", action="store_true",
                   help="kernels: how the decode kernel reads the KV pools (coalescing, bytes read), "
                        "through the MSL harness of a source checkout; needs clang-19")
    p.add_argument("--remote-tier", default=None, metavar="URL",
                   help="tiers: the server of the remote rows (default: a redis-server of the bench's own)")
    p.add_argument("--gap-tokens", type=number(int, 64), default=None, metavar="N",
                   help="tiers: the cached prefix of the stream-gap rows (default 6144, as recorded)")
    p.add_argument("--quick", action="store_true",
                   help="memory: the quantized pool's rows at small sizes (minutes on a CPU, not an hour)")
    p.add_argument("--hostfile", default=None, metavar="FILE",
                   help="distributed, mac: run the distributed rows on the set FILE names (mlx.launch's "
                        "hostfile; mlxkv at the same path on each machine), not 2 ranks on loopback")
    p.add_argument("--distributed-backend", choices=("ring", "jaccl"), default="ring",
                   help="distributed, mac: with --hostfile, MLX's transport between the ranks")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)


def _add_doctor(sub) -> None:
    p = sub.add_parser("doctor", help="BLAS, Metal, which attention path decode takes, and the cache tiers")
    p.add_argument("--json", action="store_true", help="the same report as one JSON object")
    p.add_argument("--disk-tier", default=None, metavar="DIR", help="SSD tier directory (default: the user cache dir)")
    p.add_argument("--remote-tier", default=os.environ.get(REMOTE_TIER_ENV), metavar="URL",
                   help=f"a remote tier's server to check (default: ${REMOTE_TIER_ENV})")
    p.add_argument("--kv-bits", type=int, default=None, choices=[8, 4], help="check a quantized pool's kernels")
    p.add_argument("--kv-group-size", type=int, default=None, choices=[64, 32], help="with --kv-bits (default 64)")
    p.set_defaults(func=cmd_doctor)


class OneLineErrors(argparse.ArgumentParser):
    """argparse, but a bad flag is one line, as every other mlxkv error is: the
    usage block it prints first buried the error under a screen of flags.
    Subcommands' parsers are of this class too (add_subparsers takes it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from mlxkv import __version__
    from mlxkv.connectors.commands import add_cache_parser
    from mlxkv.models.commands import add_models_parser

    parser = OneLineErrors(prog="mlxkv", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="store_true", help="print versions, BLAS and Metal, then exit")
    sub = parser.add_subparsers(dest="command")
    _add_generate(sub)
    _add_chat(sub)
    _add_serve(sub)
    _add_tiny_model(sub)
    _add_bench(sub)
    add_cache_parser(sub)
    add_models_parser(sub)
    _add_doctor(sub)
    parser.set_defaults(version_string=__version__)
    return parser


def cmd_generate(args) -> int:
    from mlxkv.generate_command import generate

    return generate(args, cache_config(args))


def cmd_serve(args) -> int:
    from mlxkv.server.server import Server, ServerOptions, api_key_from, log_serving

    log_serving("warning" if args.quiet else args.log_level)
    options = ServerOptions(args.host, args.port, api_key_from(args.api_key), args.max_open,
                            args.max_body_mb << 20, args.max_tokens, args.temp, reply_cap=args.reply_cap,
                            max_image_pixels=args.max_image_pixels, max_images=args.max_images,
                            allow_image_urls=args.allow_image_urls)
    specs, models = served_models(args)
    if args.distributed:
        from mlxkv.distributed.serving import serve_rank

        return serve_rank(args, specs, persistent_cache_config(args), options, models)
    Server.load_models(specs, persistent_cache_config(args), options, models).serve_forever()
    return 0


def served_models(args):
    """The models --model and --models name, and how they share the server (flags over the file)."""
    from mlxkv.server.backend import short_name
    from mlxkv.server.model_specs import alias_flag, model_flag
    from mlxkv.server.models_file import ModelsFile, read_models_file
    from mlxkv.server.server import ModelsOptions

    file = read_models_file(args.models) if args.models else ModelsFile()
    specs = file.specs + [model_flag(text, short_name) for text in args.model or []]
    if not specs:
        specs = [model_flag("demo", short_name)]
    models = ModelsOptions(
        aliases=[alias_flag(text) for text in args.alias] + file.aliases,
        default_model=args.default_model or file.default_model,
        max_loaded=args.max_loaded or file.max_loaded,
        memory_budget=args.memory_budget or file.memory_budget,
        keep_alive_s=args.keep_alive if args.keep_alive is not None else file.keep_alive_s)
    return specs, models


def cmd_chat(args) -> int:
    from mlxkv.models.fetch import DEFAULT_CHAT_MODEL, check_model

    from mlxkv.server.backend import short_name
    from mlxkv.server.model_specs import model_flag

    specs = [model_flag(text, short_name) for text in args.model or [DEFAULT_CHAT_MODEL]]
    if not (sys.stdin.isatty() and sys.stdout.isatty()):  # the app would wait for keys forever: say so, a bad model first
        for spec in specs:
            check_model(spec.source)
        raise MlxkvError("mlxkv chat needs a terminal (stdin or stdout is not one); "
                         "for scripts: mlxkv generate or mlxkv serve")
    from mlxkv.tui.app import run

    config = persistent_cache_config(args)
    return run([(spec.name, spec.source) for spec in specs], config, max_tokens=args.max_tokens,
               temperature=args.temp)


def cmd_tiny_model(args) -> int:
    from mlxkv.models.tiny import spec_from_args, write_tiny_model
    from mlxkv.vision.tiny_vlm import VISION_FAMILIES, write_tiny_vlm

    if args.family in VISION_FAMILIES:  # a vision-language model, from mlx-vlm's classes (the vision extra)
        path = write_tiny_vlm(args.dir, args.family, args.seed, args.vocab_size)
    else:
        path = write_tiny_model(args.dir, spec_from_args(args))
    print(path)
    return 0


def cmd_bench(args) -> int:
    from mlxkv.benchmarks import run_suite

    return run_suite(args)


def cmd_doctor(args) -> int:
    from mlxkv.attention.doctor import attention_lines, attention_report, kv_lines, kv_report
    from mlxkv.connectors.doctor import tier_lines, tier_report
    from mlxkv.system.blas import blas_report, format_doctor
    from mlxkv.system.paths import default_disk_tier_dir

    tiers = tier_report(getattr(args, "disk_tier", None) or str(default_disk_tier_dir()),
                        getattr(args, "remote_tier", None))
    kv = kv_format(args)
    report = {**blas_report(), "attention": attention_report(kv=kv), "kv": kv_report(kv), "tiers": tiers}
    if getattr(args, "json", False):
        print(json.dumps(report, indent=2))
    else:
        lines = attention_lines(report["attention"]) + kv_lines(report["kv"]) + tier_lines(tiers)
        print(format_doctor(report, lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    # transformers' tokenizer warnings (e.g. "sequence length is longer than
    # the specified maximum") would add lines to our one-line errors.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "chat":  # the chat app owns the terminal: it logs to a file
        _log_to_stderr()
    if args.version:
        print(f"mlxkv {args.version_string}")
        return cmd_doctor(args)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return args.func(args)
    except MlxkvError as e:
        print(f"mlxkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `mlxkv ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush finds a sink
        return 141  # as a shell reports a writer killed by SIGPIPE


def _log_to_stderr() -> None:
    from mlxkv.system import blas, logs

    logs.log_to_stderr()
    notice = blas.slow_blas_notice(blas.load_blas())
    if notice:  # said at import too, before anything listened
        logging.getLogger("mlxkv").warning(notice)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Our warnings as one line, like our errors (Python's own format adds the
    file, the line number and a line of our source)."""
    if issubclass(category, MlxkvWarning):
        print(f"mlxkv: warning: {warning_text(message)}", file=file or sys.stderr)
    else:
        _python_showwarning(message, category, filename, lineno, file, line)


_python_showwarning = warnings.showwarning


def run() -> None:
    """The `mlxkv` command: main(), then an exit no library teardown can hang (system/exit.py)."""
    from mlxkv.system.exit import exit_now

    exit_now(main())


if __name__ == "__main__":
    run()

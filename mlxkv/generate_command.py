"""`mlxkv generate`: replies to prompts, printed as they stream or as JSON rows."""

from __future__ import annotations

import json
import sys

from mlxkv.errors import MlxkvError

# How long a `generate --json` row waits for its background disk writes
# (they take milliseconds; a stalled disk must not hang the command).
FLUSH_TIMEOUT_S = 30.0


def generate(args, config) -> int:
    """Replies to the prompts, in order (`--concurrent`: as one batch); the command's status."""
    from mlxkv.engine.engine import Engine

    prompts = _read_prompts(args)
    if getattr(args, "distributed", None):
        engine = Engine.load(args.model, config, distributed=args.distributed,
                             distributed_check=args.distributed_check, backend=args.distributed_backend)
        if not engine.core.channel.cluster.leader:  # rank 0 prints; the others serve its plans
            engine.core.follow()
            return 0
    else:
        engine = Engine.load(args.model, config)
    with engine:
        if args.concurrent:
            return _generate_concurrent(engine, prompts, args)
        for text in prompts:
            _generate_one(engine, text, args)
    return 0


def _prompt_tokens(engine, text: str, args) -> list[int]:
    if not text.strip():
        return []  # an empty message is an empty prompt, template or not
    if args.raw:
        return engine.encode(text)
    return engine.apply_chat_template([{"role": "user", "content": text}])


def _options(args) -> dict:
    options = dict(max_tokens=args.max_tokens, temperature=args.temp, top_p=args.top_p, seed=args.seed)
    grammar = _grammar(args)
    return options if grammar is None else {**options, "grammar": grammar}


def _grammar(args):
    """--json-schema FILE, --grammar FILE (Lark) or --regex PATTERN as a structured.Grammar."""
    from mlxkv.structured.grammar import Grammar

    if getattr(args, "regex", None) is not None:
        return Grammar.regex(args.regex)
    for flag, make in (("json_schema", Grammar.json_schema), ("grammar", Grammar.lark)):
        path = getattr(args, flag, None)
        if path is not None:
            try:
                return make(_read_text(path))
            except OSError as e:
                raise MlxkvError(f"cannot read --{flag.replace('_', '-')} file {path!r}: {e.strerror}") from None
    return None


def _generate_concurrent(engine, prompts: list[str], args) -> int:
    """One batch; rows in prompt order, as without --concurrent. A bad prompt fails alone."""
    results = engine.generate_batch([_prompt_tokens(engine, t, args) for t in prompts], **_options(args))
    failed = 0
    for result in results:
        error = result.extra.get("error")
        if error is not None:
            failed += 1
            print(f"mlxkv: error: {error}", file=sys.stderr)
        elif args.json:
            print(json.dumps(_json_row(engine, result)), flush=True)
        else:
            print(result.text, flush=True)
            _print_stats(result.stats)
    return 2 if failed else 0


def _generate_one(engine, text: str, args) -> None:
    tokens = _prompt_tokens(engine, text, args)
    options = _options(args)
    if args.json:
        result = engine.generate(tokens, **options)
        print(json.dumps(_json_row(engine, result)), flush=True)
    else:
        _print_stream(engine.stream(tokens, **options))


def _json_row(engine, result) -> dict:
    """A reply's JSON row: the result, how the pool stores K/V, and the tiers' counters."""
    layout = engine.kv_layout
    return {**result.as_json(), "kv_format": layout.kv_format, "kv_bytes_per_token": layout.bytes_per_token,
            "connector": _connector_stats(engine)}


def _connector_stats(engine) -> dict:
    """The connector's counters once the prompt's background disk writes are done,
    so a JSON row counts its own stores (a tier without a writer has no flush)."""
    flush = getattr(engine.connector, "flush", None)
    if flush is not None:
        flush(FLUSH_TIMEOUT_S)
    return engine.connector.stats()


def _print_stream(chunks) -> None:
    stats = None
    for chunk in chunks:
        print(chunk.text, end="", flush=True)
        stats = chunk.stats or stats
    print()
    if stats is not None:
        _print_stats(stats)


def _print_stats(stats) -> None:
    waited = f", queued {stats.queued_s * 1000:.1f} ms" if stats.queued_s or stats.preempted_s else ""
    if stats.preemptions:
        waited += f", preempted {stats.preemptions}x for {stats.preempted_s * 1000:.1f} ms"
    print(
        f"[{stats.prompt_tokens} prompt tokens, {stats.cached_tokens} reused, "
        f"{stats.computed_tokens} computed; ttft {stats.ttft_s * 1000:.1f} ms, "
        f"{stats.decode_tokens_per_s:.1f} tok/s{waited}]",
        file=sys.stderr,
    )


def _read_text(path: str) -> str:
    """A prompt file's text, strictly UTF-8. Stdin too: Python reads a pipe with
    surrogate escapes under a C locale, which the tokenizer then rejected with
    a TypeError."""
    if path != "-":
        with open(path, encoding="utf-8") as f:
            return f.read()
    stdin = getattr(sys.stdin, "buffer", None)
    return sys.stdin.read() if stdin is None else stdin.read().decode("utf-8")


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    for path in args.prompt_file:
        try:
            prompts.append(_read_text(path))
        except OSError as e:
            raise MlxkvError(f"cannot read prompt file {path!r}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise MlxkvError(f"cannot read prompt file {path!r}: not UTF-8 text (byte {e.start})") from None
    if not prompts:
        raise MlxkvError("no prompt given; use --prompt TEXT or --prompt-file PATH")
    return prompts

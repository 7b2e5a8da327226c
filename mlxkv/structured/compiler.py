"""Compiling grammars for one tokenizer, once each: an LRU cache of compiled matchers.

Agents send the same tools on every turn, so a grammar compiles once per
(grammar, tokenizer): the compiler belongs to one tokenizer, and each row
gets a copy of the cached matcher (a copy is microseconds; a compile,
milliseconds to more for a large schema). The stats say hits, misses and
the time spent compiling.

llguidance's tokenizer is built from the Hugging Face one (about a second
for a large vocabulary) on the compiler's worker thread, started when the
compiler is made at load: built on the engine thread at first use, it
stalled every running request's step. The model's EOS ids are given
explicitly: left to itself, `LLTokenizer` took token 0.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mlxkv.errors import MlxkvError
from mlxkv.structured.grammar import Grammar
from mlxkv.structured.matcher import RowMatcher

log = logging.getLogger(__name__)

CACHE_SIZE = 64  # compiled grammars kept: an agent's few tool sets, many times over


@dataclass
class CompileStats:
    hits: int = 0
    misses: int = 0
    compile_s: float = 0.0  # all compiles so far
    last_compile_s: float = 0.0
    mask_s: float = 0.0  # computing and applying masks, all steps (masks.py adds)
    mask_steps: int = 0

    def as_dict(self) -> dict:
        return {"compile_cache_hits": self.hits, "compile_cache_misses": self.misses,
                "compile_s": round(self.compile_s, 6), "last_compile_s": round(self.last_compile_s, 6),
                "mask_s": round(self.mask_s, 6), "mask_steps": self.mask_steps}


def check_grammar(grammar: Grammar) -> None:
    """Raise MlxkvError naming what llguidance cannot compile (no tokenizer needed: a
    server checks a request's grammar before queueing it)."""
    import llguidance

    try:
        text = grammar.llguidance()
    except Exception as e:  # llguidance's own parse of a Lark grammar or a regex raises
        raise MlxkvError(f"the {grammar.kind} grammar does not compile: {_one_line(e)}") from None
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        raise MlxkvError(f"the {grammar.kind} grammar does not compile: {_one_line(error)}")


def _one_line(error) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return " / ".join(lines[:3]) if lines else type(error).__name__


class GrammarCompiler:
    """Grammars compiled for one tokenizer. Thread-safe: the engine thread compiles; a
    server's workers may check. `vocab_size` is the model's logits width."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, capacity: int = CACHE_SIZE):
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(int(t) for t in eos_ids)
        self.capacity = capacity
        self.stats = CompileStats()
        self._executor = None
        self._worker = None
        self._cache: OrderedDict[Grammar, object] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer = self.worker.submit(self._build_tokenizer)  # a Future: ready by the first grammar

    @property
    def ll_tokenizer(self):
        """llguidance's tokenizer (waits for the worker thread's build if a grammar comes that soon)."""
        return self._ll_tokenizer.result()

    def _build_tokenizer(self):
        from mlxkv.models.compat import hf_tokenizer
        import llguidance.hf

        return llguidance.hf.from_tokenizer(hf_tokenizer(self._hf), n_vocab=self.vocab_size, eos_token=self.eos_ids)

    @property
    def executor(self):
        """llguidance's executor: the batch's masks in one call, on its own threads."""
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor

    @property
    def worker(self) -> ThreadPoolExecutor:
        """One thread where a decode step's masks are computed while the engine thread starts
        the forward (masks.py); idle between steps, it ends with the process."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="mlxkv-masks")
        return self._worker

    def matcher(self, grammar: Grammar) -> RowMatcher:
        """A fresh matcher for one row (MlxkvError if the grammar does not compile)."""
        if not isinstance(grammar, Grammar):
            raise MlxkvError(f"grammar must be an mlxkv.structured.Grammar, got {type(grammar).__name__}")
        return RowMatcher(self._compiled(grammar).deep_copy(), self, grammar)

    def _compiled(self, grammar: Grammar):
        with self._lock:
            compiled = self._cache.get(grammar)
            if compiled is not None:
                self._cache.move_to_end(grammar)
                self.stats.hits += 1
                return compiled
        compiled = self._compile(grammar)  # outside the lock: a long compile holds up no one else
        with self._lock:
            self._cache[grammar] = compiled
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, grammar: Grammar):
        import llguidance

        tokenizer = self.ll_tokenizer  # built once, not a compile's time
        start = time.perf_counter()
        check_grammar(grammar)
        matcher = llguidance.LLMatcher(tokenizer, grammar.llguidance(), log_level=0)
        if matcher.is_error():
            raise MlxkvError(f"the {grammar.kind} grammar does not compile: {_one_line(matcher.get_error())}")
        elapsed = time.perf_counter() - start
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_s += elapsed
            self.stats.last_compile_s = elapsed
        log.debug("compiled %s in %.1f ms", grammar.describe(), elapsed * 1e3)
        return matcher

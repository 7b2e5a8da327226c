"""Prompt lookup: propose the tokens that followed the last earlier occurrence of the newest ones.

Coding agents rewrite files they have just read and repeat paths,
identifiers and tool output from their prompt, so after an earlier
occurrence of a sequence's last few tokens, the tokens that followed are
often the next ones. The index maps every n-gram (n from MAX_N down to 1)
to where its latest occurrence was followed, as tokens come: a proposal is
a dict lookup per n, never a scan of the context.
"""

from __future__ import annotations

MAX_N = 3
_BITS = 21  # a token id per field of a packed n-gram key (vocabularies are under 2**21)


class PromptLookup:
    def __init__(self, tokens: list[int] = (), max_n: int = MAX_N):
        self.max_n = max_n
        self.tokens: list[int] = []
        # n -> {packed n-gram: position of the token that followed its latest occurrence}
        self._follows: list[dict[int, int]] = [{} for _ in range(max_n + 1)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        for token in tokens:
            i = len(self.tokens)
            key = 0
            for n in range(1, min(self.max_n, i) + 1):  # the n-grams ending just before this token
                key |= self.tokens[i - n] << (_BITS * (n - 1))
                self._follows[n][key] = i
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest recent n-gram matching the newest tokens."""
        if k < 1:
            return []
        end = len(self.tokens)
        key, keys = 0, []
        for n in range(1, min(self.max_n, end) + 1):
            key |= self.tokens[end - n] << (_BITS * (n - 1))
            keys.append(key)
        for n in range(len(keys), 0, -1):
            at = self._follows[n].get(keys[n - 1])
            if at is not None:
                return self.tokens[at : at + k]
        return []

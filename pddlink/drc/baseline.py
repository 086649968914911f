"""A token-list radix tree of the kind SGLang uses, the baseline that ``pddlink bench drc`` beats.

Written from the description of SGLang's ``RadixCache`` (not copied): each node holds a list of token
ids as its edge key, children are keyed by the first page of their key, and a match walks down the
tree comparing token lists: token by token at page size 1, a page-long slice at a time otherwise,
splitting an edge where a match ends inside it. No hashing, no LRU, no eviction: only what a match and
an insert cost. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from pddlink.errors import InvalidInput


class _TokenNode:
    __slots__ = ("children", "key")

    def __init__(self, key: list[int]) -> None:
        self.key = key
        self.children: dict[object, _TokenNode] = {}


class TokenRadixTree:
    """Radix tree over token lists; ``page_size`` tokens are compared (and cached) at a time."""

    def __init__(self, page_size: int = 1) -> None:
        if page_size < 1:
            raise InvalidInput(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._root = _TokenNode([])
        self.cached_tokens = 0

    def _child_key(self, key: list[int]) -> object:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _common(self, a: list[int], b: list[int]) -> int:
        """Length of the common prefix of two token lists, in whole pages."""
        i = 0
        if self.page_size == 1:
            for x, y in zip(a, b, strict=False):
                if x != y:
                    break
                i += 1
            return i
        p = self.page_size
        n = min(len(a), len(b))
        while i + p <= n and a[i : i + p] == b[i : i + p]:
            i += p
        return i

    def _split(self, node: _TokenNode, at: int) -> _TokenNode:
        """Splits ``node``'s edge after ``at`` tokens; returns the new upper node, already linked."""
        upper = _TokenNode(node.key[:at])
        node.key = node.key[at:]
        upper.children[self._child_key(node.key)] = node
        return upper

    def match_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens are cached (a multiple of the page size)."""
        key = list(tokens[: len(tokens) - len(tokens) % self.page_size])
        node, matched = self._root, 0
        while key:
            ck = self._child_key(key)
            child = node.children.get(ck)
            if child is None:
                break
            n = self._common(child.key, key)
            matched += n
            if n < len(child.key):
                node.children[ck] = self._split(child, n)
                break
            node, key = child, key[n:]
        return matched

    def insert(self, tokens: Sequence[int]) -> int:
        """Caches the whole pages of ``tokens``; returns how many tokens were new."""
        key = list(tokens[: len(tokens) - len(tokens) % self.page_size])
        node = self._root
        while key:
            ck = self._child_key(key)
            child = node.children.get(ck)
            if child is None:
                node.children[ck] = _TokenNode(key)
                self.cached_tokens += len(key)
                return len(key)
            n = self._common(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
                node.children[ck] = child
            node, key = child, key[n:]
        return 0

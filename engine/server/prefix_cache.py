"""A prefix (radix) cache of KV keyed by token ids, for the reference engine.

Each node holds a run of tokens and their KV per layer ([1, kv_heads, run length, head_dim] keys and values); the
path from the root spells a cached sequence. `match` returns the KV of the longest cached prefix (views into a node
when one node holds it, else a concatenation; callers never write into it, and nodes' tensors are replaced, never
written, so a view stays valid), `insert` adds a sequence's KV, splitting nodes where it diverges. The total number
of cached tokens is bounded by a budget; over it, least recently used leaves are evicted (as SGLang's RadixCache).
Requests hold their own references to what they match, so nothing needs locking against eviction (an evicted node's
KV lives on while a running row still reads it); a threading lock serialises the scheduler's worker thread and
`clear` from the event loop.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Sequence

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [1, kv_heads, length, head_dim]


class _Node:
    __slots__ = ("tokens", "kv", "children", "parent", "last_used")

    def __init__(self, tokens: tuple[int, ...], kv: KV, parent: _Node | None, last_used: int) -> None:
        self.tokens = tokens
        self.kv = kv
        self.children: dict[int, _Node] = {}  # keyed by the child's first token
        self.parent = parent
        self.last_used = last_used


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences (lists or tuples), by bisection over slice comparisons."""
    a, b = list(a), list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


_common = common_prefix


def _slice(kv: KV, start: int, end: int | None = None) -> KV:
    # clone: a node must not keep alive the (larger) tensor it was cut from, or the token budget would lie
    return [(k[:, :, start:end].clone(), v[:, :, start:end].clone()) for k, v in kv]


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._root = _Node((), [], None, 0)
        self._tokens = 0
        self._clock = itertools.count(1)  # LRU stamps
        self._lock = threading.Lock()
        self.evicted_tokens = 0
        self.epoch = 0  # bumped by clear: an insert of KV snapshotted before a flush is dropped

    @property
    def tokens(self) -> int:
        return self._tokens

    def clear(self) -> None:
        with self._lock:
            self._root = _Node((), [], None, 0)
            self._tokens = 0
            self.epoch += 1

    def match(self, ids: Sequence[int]) -> tuple[int, KV | None]:
        """(length of the longest cached prefix of `ids`, its KV per layer; None when 0). The KV is read-only:
        views into a node when one node holds the prefix, else a concatenation."""
        with self._lock:
            stamp = next(self._clock)
            node, pos = self._root, 0
            parts: list[KV] = []
            while pos < len(ids):
                child = node.children.get(ids[pos])
                if child is None:
                    break
                n = _common(child.tokens, ids[pos:])
                child.last_used = stamp
                parts.append(child.kv if n == len(child.tokens) else [(k[:, :, :n], v[:, :, :n]) for k, v in child.kv])
                pos += n
                if n < len(child.tokens):
                    break
                node = child
            if pos == 0:
                return 0, None
            if len(parts) == 1:  # one node: views of its KV (node tensors are never written, only replaced)
                return pos, list(parts[0])
            layers = [
                (torch.cat([p[li][0] for p in parts], dim=2), torch.cat([p[li][1] for p in parts], dim=2))
                for li in range(len(parts[0]))
            ]
            return pos, layers

    def peek(self, ids: Sequence[int]) -> int:
        """Length of the longest cached prefix of `ids` (no KV, no LRU stamp)."""
        with self._lock:
            return self._peek(ids)

    def _peek(self, ids: Sequence[int]) -> int:
        node, pos = self._root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = _common(child.tokens, ids[pos : pos + len(child.tokens)])
            pos += n
            if n < len(child.tokens):
                break
            node = child
        return pos

    def insert(self, ids: Sequence[int], kv: KV, epoch: int | None = None, kv_start: int = 0) -> bool:
        """Cache `ids` (KV of all of them in `kv`, possibly longer than `ids`: the rest is ignored). With `epoch`
        (read before the KV was computed), nothing is cached when the cache was cleared since. With `kv_start`, `kv`
        starts at that token: when the cache lacks some of the tokens before it, nothing is cached and the answer is
        False (the caller may insert the whole KV instead)."""
        if self.max_tokens <= 0 or not ids:
            return True
        ids = tuple(ids[: self.max_tokens])  # a sequence over the whole budget keeps its head
        with self._lock:
            if epoch is not None and epoch != self.epoch:
                return True
            if kv_start and self._peek(ids[:kv_start]) < min(kv_start, len(ids)):
                return False
            stamp = next(self._clock)
            node, pos = self._root, 0
            while pos < len(ids):
                child = node.children.get(ids[pos])
                if child is None:
                    leaf = _Node(ids[pos:], _slice(kv, pos - kv_start, len(ids) - kv_start), node, stamp)
                    node.children[ids[pos]] = leaf
                    self._tokens += len(leaf.tokens)
                    break
                n = _common(child.tokens, ids[pos:])
                if n < len(child.tokens):
                    child = self._split(child, n)
                child.last_used = stamp
                pos += n
                node = child
            self._evict()
            return True

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut `node` after its first n tokens; returns the new upper part (the node's place in the tree)."""
        assert node.parent is not None
        upper = _Node(node.tokens[:n], _slice(node.kv, 0, n), node.parent, node.last_used)
        node.parent.children[upper.tokens[0]] = upper
        node.tokens, node.kv, node.parent = node.tokens[n:], _slice(node.kv, n), upper
        upper.children[node.tokens[0]] = node
        return upper

    def _evict(self) -> None:
        if self._tokens <= self.max_tokens:
            return
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        while self._tokens > self.max_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.tokens[0]]
            self._tokens -= len(leaf.tokens)
            self.evicted_tokens += len(leaf.tokens)
            if parent is not self._root and not parent.children:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

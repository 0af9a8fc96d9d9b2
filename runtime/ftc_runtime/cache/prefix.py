"""`PrefixCache`: a radix tree over token ids holding the keys and values of past sequences, and
recurrent-state checkpoints at agent-edit boundaries, so that a new prompt resumes after its
longest cached prefix instead of prefilling it again.

Each node owns the KV of its edge's tokens (one tensor per full-attention layer), so the tree can
split at any token and a checkpoint at a boundary token has its KV right up to it. A model with
linear-attention layers (Gated DeltaNet) can only resume where a checkpoint holds their complete
state: the deepest node on the matched path that ends in one. Two LRU byte budgets, one for KV (on
the device, beside the sequences' caches) and one for checkpoints, which live in host memory: one
is tens of MB at real shapes (qwen3.6: 30 linear layers of fp32 state), restoring it is one copy of
about a millisecond, and the device's memory goes to expert slots instead. A node that a running
sequence holds (reference count) is never evicted, and correctness never depends on the cache: a
miss only costs prefill. Sequences live in namespaces (a server keeps one per API key), each a
tree of its own: a prompt never resumes from another namespace's tokens, so time to first token
tells nothing about what another user sent.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

from ftc_runtime.cache.base import RecurrentCheckpoint, SequenceState

_clock = itertools.count(1)
TOKEN_BYTES = 8  # a token id in a node's tuple: one pointer (small ints are shared)


@dataclass(eq=False)
class RadixNode:
    tokens: tuple[int, ...]  # the edge from the parent
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per full-attention layer: keys, values [len(tokens), kv, d]
    parent: RadixNode | None = None
    children: dict[int, RadixNode] = field(default_factory=dict)
    checkpoint: RecurrentCheckpoint | None = None  # the linear layers' state after this node's last token
    refs: int = 0  # sequences that hold this node (resumed from it or below)
    last_used: int = 0

    @property
    def kv_bytes(self) -> int:
        """Its keys and values, and its token ids (all a node of a model without per-token keys
        holds, DeepSeek-V4's: so that the budget bounds its tree too)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv) \
            + TOKEN_BYTES * len(self.tokens)


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0  # lookups that resumed after at least one token
    reused_tokens: int = 0
    inserted_tokens: int = 0
    kv_evictions: int = 0  # nodes dropped
    checkpoint_evictions: int = 0

    def to_dict(self) -> dict:
        return dict(vars(self))


@dataclass(frozen=True)
class Resume:
    """Where a prompt resumes: `length` tokens restored into the cache, the node path held."""

    length: int
    held: tuple[RadixNode, ...]


class PrefixCache:
    def __init__(self, kv_budget: int, checkpoint_budget: int, recurrent: bool):
        self.kv_budget, self.checkpoint_budget = kv_budget, checkpoint_budget
        self.recurrent = recurrent  # the model has linear layers: resume only at checkpoints
        self.roots: dict[str, RadixNode] = {}  # namespace → its tree's root
        self.kv_used = self.checkpoint_used = 0
        self.stats = PrefixStats()

    @property
    def takes_checkpoints(self) -> bool:
        """Prompts capture their linear layers' state at boundaries: a hybrid model, with room for
        checkpoints (each capture copies every linear layer's state, which is wasted without that
        room; docs/performance.md has its cost)."""
        return self.recurrent and self.checkpoint_budget > 0

    # -- lookup ------------------------------------------------------------------------------

    def resume(self, ids: list[int], cache: SequenceState, namespace: str = "") -> Resume:
        """Restores the longest usable cached prefix of `ids` in `namespace` (at most all but the
        last token, so that the prompt still yields logits) into an empty `cache`, and holds its
        nodes until `release`; the `Resume` says how many tokens it restored."""
        self.stats.lookups += 1
        path, matched = self._match(self._root(namespace), ids[:-1])
        if self.recurrent:  # to the end of the deepest whole node whose checkpoint survives
            if matched < self._depth(path):
                path = path[:-1]
            while path and path[-1].checkpoint is None:
                path = path[:-1]
            matched = self._depth(path)
        held = tuple(path)
        for node in held:
            node.refs += 1
            node.last_used = next(_clock)
        if matched:
            self._restore(held, matched, cache)
            self.stats.hits += 1
            self.stats.reused_tokens += matched
        return Resume(matched, held)

    def release(self, resume: Resume) -> None:
        for node in resume.held:
            node.refs -= 1

    def _root(self, namespace: str) -> RadixNode:
        return self.roots.setdefault(namespace, RadixNode((), []))

    @staticmethod
    def _match(root: RadixNode, ids: list[int]) -> tuple[list[RadixNode], int]:
        """The nodes along `ids` below `root` and how many tokens match (the last node may match
        only partly)."""
        node, path, i = root, [], 0
        while i < len(ids) and ids[i] in node.children:
            child = node.children[ids[i]]
            n = _common(child.tokens, ids[i:])
            path.append(child)
            i += n
            if n < len(child.tokens):
                break
            node = child
        return path, i

    @staticmethod
    def _depth(path: list[RadixNode] | tuple[RadixNode, ...]) -> int:
        return sum(len(n.tokens) for n in path)

    def _restore(self, path: tuple[RadixNode, ...], length: int, cache: SequenceState) -> None:
        kv = cache.kv
        if kv.length:
            raise ValueError("PrefixCache.resume needs an empty cache")
        counts, start = [], 0
        for node in path:
            counts.append(min(len(node.tokens), length - start))
            start += counts[-1]
        for layer in range(kv.num_layers):  # append writes every layer at `length`, still 0
            kv.append(layer, torch.cat([n.kv[layer][0][:c] for n, c in zip(path, counts, strict=True)]),
                      torch.cat([n.kv[layer][1][:c] for n, c in zip(path, counts, strict=True)]))
        kv.length = length
        if cache.recurrent:
            cache.restore(path[-1].checkpoint)

    # -- insert ------------------------------------------------------------------------------
    def insert(self, ids: list[int], cache: SequenceState,
               checkpoints: dict[int, RecurrentCheckpoint], namespace: str = "") -> None:
        """Adds the sequence `ids` (whose keys and values `cache` holds, at least len(ids) of them)
        and its checkpoints (by the number of tokens they follow) to `namespace`, then evicts down
        to the budgets."""
        kv = cache.kv
        if kv.length < len(ids):
            raise ValueError(f"insert: the cache holds {kv.length} tokens, the sequence has {len(ids)}")
        root = self._root(namespace)
        node, i = root, 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                end = len(ids)
                child = RadixNode(tuple(ids[i:]), [(kv.keys(layer)[i:end].clone(), kv.values(layer)[i:end].clone())
                                                  for layer in range(kv.num_layers)], node)
                node.children[ids[i]] = child
                self.kv_used += child.kv_bytes
                self.stats.inserted_tokens += len(child.tokens)
            n = _common(child.tokens, ids[i:])
            if n < len(child.tokens):
                child = self._split(child, n)
            child.last_used = next(_clock)
            node, i = child, i + n
        for at, checkpoint in checkpoints.items():
            self._attach(root, ids[:at], checkpoint)
        self._evict()

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cuts `node` after its first n tokens; returns the upper part (the lower keeps the
        checkpoint, children and holders)."""
        # The upper part is an ancestor of the lower one, so never a leaf while that exists: it
        # needs no reference count of its own to stay.
        upper = RadixNode(node.tokens[:n], [(k[:n].clone(), v[:n].clone()) for k, v in node.kv], node.parent,
                          last_used=node.last_used)
        node.parent.children[node.tokens[0]] = upper
        node.tokens, node.kv, node.parent = node.tokens[n:], [(k[n:].clone(), v[n:].clone()) for k, v in node.kv], upper
        upper.children[node.tokens[0]] = node
        return upper

    def _attach(self, root: RadixNode, prefix: list[int], checkpoint: RecurrentCheckpoint) -> None:
        path, matched = self._match(root, prefix)
        if not prefix or matched < len(prefix):
            return  # evicted meanwhile
        node = path[-1]
        if self._depth(path) > len(prefix):
            node = self._split(node, len(node.tokens) - (self._depth(path) - len(prefix)))
        if node.checkpoint is None:
            node.checkpoint = checkpoint.to("cpu")
            self.checkpoint_used += node.checkpoint.nbytes

    # -- eviction ----------------------------------------------------------------------------
    def _evict(self) -> None:
        """Least recently used first, among what no sequence holds: checkpoints down to their
        budget, then leaves (with their checkpoints) down to the KV budget; a parent whose last
        child goes becomes a leaf in turn. One walk of the tree, then a heap."""
        if self.checkpoint_used <= self.checkpoint_budget and self.kv_used <= self.kv_budget:
            return
        nodes = self._nodes()
        held = [(n.last_used, id(n), n) for n in nodes if n.checkpoint is not None and n.refs == 0]
        heapq.heapify(held)
        while self.checkpoint_used > self.checkpoint_budget and held:
            victim = heapq.heappop(held)[2]
            self.checkpoint_used -= victim.checkpoint.nbytes
            victim.checkpoint = None
            self.stats.checkpoint_evictions += 1
        leaves = [(n.last_used, id(n), n) for n in nodes if not n.children and n.refs == 0]
        heapq.heapify(leaves)
        while self.kv_used > self.kv_budget and leaves:
            victim = heapq.heappop(leaves)[2]
            parent = victim.parent
            del parent.children[victim.tokens[0]]
            self.kv_used -= victim.kv_bytes
            if victim.checkpoint is not None:
                self.checkpoint_used -= victim.checkpoint.nbytes
            self.stats.kv_evictions += 1
            if parent.parent is not None and not parent.children and parent.refs == 0:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    @property
    def checkpoints(self) -> int:
        return sum(1 for n in self._nodes() if n.checkpoint is not None)


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n

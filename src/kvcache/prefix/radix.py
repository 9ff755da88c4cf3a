"""RadixIndex: a tree over token ids whose nodes hold pages of the KV pool.

Tensor-free and allocator-free, so it is unit-tested without a model. Each node is one page of
tokens: ``tokens`` holds ``page_size`` ids (a full page, which may have children) or fewer (a
partly filled last page, always a leaf). ``pages[g]`` is the pool page of layer group ``g`` holding
those tokens' K/V, or HOLE where a windowed group had already dropped it.

The index holds one reference to every page it stores; the caller turns the page lists that
``insert`` and ``evict`` return into allocator increfs and releases. Which pages are still in use
by a running sequence is the caller's knowledge too (``in_use`` callbacks), so eviction never takes
a page from a live sequence.

One tree per tenant salt: requests under different salts never see each other's nodes.

Locking: none; the engine calls it from one thread.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

HOLE = -1


class Node:
    __slots__ = ("parent", "tokens", "pages", "children", "last_used", "hits", "key")

    def __init__(self, parent: "Node | None", tokens: tuple[int, ...], pages: list[int]) -> None:
        self.parent = parent
        self.tokens = tokens
        self.pages = pages  # per layer group: pool page or HOLE
        self.children: dict[tuple[int, ...], Node] = {}
        self.last_used = 0
        self.hits = 0
        self.key: bytes | None = None  # chained tier key, filled by the caller when tiers are on

    def live_pages(self) -> Iterator[tuple[int, int]]:
        """(group, page) of every page this node holds."""
        for g, p in enumerate(self.pages):
            if p != HOLE:
                yield g, p


@dataclass
class Match:
    """The nodes along a prompt's cached prefix and how many of its tokens they cover (the last
    node may be covered only partly: a page shared up to a token inside it)."""

    nodes: list[Node]
    length: int

    def tables(self, num_groups: int) -> list[list[int]]:
        return [[n.pages[g] for n in self.nodes] for g in range(num_groups)]


class RadixIndex:
    def __init__(self, page_size: int, num_groups: int, policy: str = "lru", partial: bool = True) -> None:
        if policy not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {policy!r}: lru or lfu")
        self.page_size = page_size
        self.num_groups = num_groups
        self.policy = policy
        self.partial = partial  # whether a match may end inside a page (float pools; not quantized)
        self.roots: dict[str, Node] = {}
        self._clock = itertools.count(1)
        self.num_nodes = 0

    def root(self, salt: str = "") -> Node:
        if salt not in self.roots:
            self.roots[salt] = Node(None, (), [HOLE] * self.num_groups)
        return self.roots[salt]

    # -- lookup ---------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], salt: str = "", touch: bool = True) -> Match:
        """The longest cached prefix of ``tokens`` (page by page; the last page may match partly)."""
        ps, node, nodes, i = self.page_size, self.roots.get(salt), [], 0
        if node is None:
            return Match([], 0)
        while i < len(tokens):
            chunk = tuple(tokens[i : i + ps])
            child = node.children.get(chunk) if len(chunk) == ps else None
            if child is not None:
                nodes.append(child)
                node, i = child, i + ps
                continue
            if self.partial:  # the child sharing the most leading tokens, if any
                best, best_n = None, 0
                for key, c in node.children.items():
                    n = common_prefix(key, chunk)
                    if n > best_n:
                        best, best_n = c, n
                if best is not None:
                    nodes.append(best)
                    i += best_n
            break
        if touch:
            self.touch(nodes)
        return Match(nodes, i)

    def touch(self, nodes: Sequence[Node]) -> None:
        now = next(self._clock)
        for n in nodes:
            n.last_used = now
            n.hits += 1

    def child(self, node: Node, tokens: tuple[int, ...]) -> Node | None:
        return node.children.get(tokens)

    # -- insertion ------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], tables: Sequence[Sequence[int]], salt: str = "") -> tuple[list[Node], list[tuple[int, int]]]:
        """Record that ``tables[g][i]`` holds page i of ``tokens`` in group g. Returns the path of
        nodes and the (group, page) pairs the index newly holds (incref them). Pages already in
        the index stay as they are (the caller's copies are not taken); a node whose group page
        was HOLE adopts the caller's page."""
        ps, node = self.page_size, self.root(salt)
        path: list[Node] = []
        taken: list[tuple[int, int]] = []
        now = next(self._clock)
        for i in range(0, len(tokens), ps):
            chunk = tuple(tokens[i : i + ps])
            pages = [t[i // ps] if i // ps < len(t) else HOLE for t in tables]
            child = node.children.get(chunk)
            if child is None:
                if len(chunk) < ps and not self.partial:
                    break
                child = Node(node, chunk, pages)
                node.children[chunk] = child
                self.num_nodes += 1
                taken += child.live_pages()
            else:
                for g, p in enumerate(pages):
                    if child.pages[g] == HOLE and p != HOLE:
                        child.pages[g] = p
                        taken.append((g, p))
            child.last_used = now
            path.append(child)
            if len(chunk) < ps:
                break
            node = child
        return path, taken

    def add_child(self, parent: Node, tokens: tuple[int, ...], pages: list[int]) -> Node:
        """A node for a page restored from a tier (the caller already holds its pages' refs)."""
        child = Node(parent, tokens, pages)
        child.last_used = next(self._clock)
        parent.children[tokens] = child
        self.num_nodes += 1
        return child

    # -- eviction -------------------------------------------------------------------------------
    def evict(self, need: int, group: int | None, in_use: Callable[[int, int], bool]) -> list[Node]:
        """Drop least recently (or least frequently) used leaves whose pages no live sequence
        holds until ``need`` pages of ``group`` (any group when None) are released; a parent
        that becomes a leaf may go next. Returns the dropped nodes (release their pages)."""
        heap = [(self._rank(n), id(n), n) for n in self._leaves() if self._evictable(n, in_use)]
        heapq.heapify(heap)
        dropped: list[Node] = []
        freed = 0
        while heap and freed < need:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.tokens]
            self.num_nodes -= 1
            dropped.append(node)
            freed += sum(1 for g, _ in node.live_pages() if group is None or g == group)
            if parent.parent is not None and not parent.children and self._evictable(parent, in_use):
                heapq.heappush(heap, (self._rank(parent), id(parent), parent))
        return dropped

    def _rank(self, node: Node) -> tuple[int, int]:
        return (node.hits, node.last_used) if self.policy == "lfu" else (node.last_used, 0)

    @staticmethod
    def _evictable(node: Node, in_use: Callable[[int, int], bool]) -> bool:
        return not any(in_use(g, p) for g, p in node.live_pages())

    def _leaves(self) -> Iterator[Node]:
        for n in self.nodes():
            if not n.children:
                yield n

    def nodes(self, salt: str | None = None) -> Iterator[Node]:
        """Every node (roots excluded), parents before children; only tenant ``salt``'s when given."""
        roots = self.roots.values() if salt is None else [self.roots[salt]] if salt in self.roots else []
        stack = [c for r in roots for c in r.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def held_pages(self) -> dict[int, list[int]]:
        """Per group, the pages the index holds (each once)."""
        out: dict[int, list[int]] = {g: [] for g in range(self.num_groups)}
        for n in self.nodes():
            for g, p in n.live_pages():
                out[g].append(p)
        return out

    def remap(self, group: int, moves: dict[int, int]) -> None:
        """Renumber group ``group``'s pages (old -> new) after the pool moved them."""
        for n in self.nodes():
            p = n.pages[group]
            if p in moves:
                n.pages[group] = moves[p]

    def clear(self) -> list[Node]:
        """Drop every node (release their pages)."""
        dropped = list(self.nodes())
        self.roots.clear()
        self.num_nodes = 0
        return dropped


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

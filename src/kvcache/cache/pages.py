"""PageManager: the one owner of a cache's pages.

Every page of every pool is allocated, shared, given back, evicted, moved and counted here and
nowhere else: the cache's sequences, its retention (cache/retention.py), the prefix index
(prefix/) and the scheduler all go through this interface. It holds one ``PageAllocator`` (free
list and reference counts) per layer group; no other code sees them. It reads the cache's pools,
groups and sequences through the ``CacheParts`` protocol (cache/parts.py) and its page arithmetic
(room under a budget, capacity, pages a length needs) from cache/capacity.py, so it imports
nothing above it.

The interface:

- for a step: ``ask(seqs, tokens)`` -> a ``Reservation`` (the pages for every sequence's new
  tokens are in their tables) or a ``Refusal`` (typed: ``full`` or ``context``; nothing was
  taken). The scheduler asks before a forward; the forward's plan then finds the pages there.
  ``cancel(seq)`` (or ``Reservation.cancel``) gives back what a step that did not run had taken;
- per sequence: ``reserve`` (raising), ``release`` (free every page), ``truncate(seq, n)``,
  ``share_tables`` (a fork), copy-on-write of shared partial pages, windows' dead pages;
- per page: ``take(group, n)`` (fresh pages, reclaiming from the evictor and growing a dynamic pool
  first), ``share`` (one more reference), ``drop`` (one less), ``refcount``/``shared``;
- counts and upkeep: ``stats``, ``free``, ``total``, ``used``, ``fit`` (a pool's first size under a budget),
  ``shrink`` (pages in use moved down, pools cut), ``check`` (the allocators' own consistency).

Locking: none; called on the thread that owns the cache (the engine thread).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kvcache.cache import retention
from kvcache.cache.allocator import PageAllocator
from kvcache.cache.capacity import capacity_per_sequence, pages_after, room
from kvcache.cache.parts import CacheParts
from kvcache.cache.qpool import QuantPool
from kvcache.cache.sequence import HOLE, SeqKV
from kvcache.errors import CacheFull, ContextOverflow, KVCacheError


@dataclass(frozen=True)
class Refusal:
    """Why a step's pages cannot be had; nothing was taken. ``kind``: ``full`` (a static pool is
    full, or a budgeted one is at its budget, after the evictor gave back what it could) or
    ``context`` (a sequence would pass what one sequence may hold)."""

    kind: str
    message: str

    def error(self) -> KVCacheError:
        return CacheFull(self.message) if self.kind == "full" else ContextOverflow(self.message)


@dataclass
class Reservation:
    """The pages one step asked for, in place in its sequences' tables (their ``pending`` says
    where they start) until a forward commits them or ``cancel`` gives them back."""

    manager: "PageManager"
    seqs: list[SeqKV]

    def cancel(self) -> None:
        """Give back what no forward has used (a forward that ran committed it)."""
        for seq in self.seqs:
            self.manager.cancel(seq)


class PageManager:
    def __init__(self, cache: CacheParts, pages: int) -> None:
        self.cache = cache
        self._allocs = [PageAllocator(pages) for _ in cache.groups]

    # -- counts -----------------------------------------------------------------------------------
    def free(self, group: int) -> int:
        return self._allocs[group].num_free

    def total(self, group: int) -> int:
        return self._allocs[group].total

    def used(self, group: int) -> int:
        """Pages with at least one holder."""
        return self._allocs[group].num_referenced

    def refcount(self, group: int, page: int) -> int:
        return self._allocs[group].refcount(page)

    def shared(self, group: int, page: int) -> bool:
        """Whether ``page`` has more than one holder."""
        return self._allocs[group].refcount(page) > 1

    def stats(self) -> list[dict[str, int]]:
        """Per layer group: pages in the pool, with a holder, free, and with more than one holder
        (shared by forks or by the prefix index and a sequence)."""
        return [{"total": a.total, "used": a.num_referenced, "free": a.num_free,
                 "shared": sum(1 for p in range(a.total) if a.refcount(p) > 1)} for a in self._allocs]

    def check(self, group: int) -> None:
        """The group's free list and reference counts agree (AssertionError otherwise)."""
        self._allocs[group].check_integrity()

    # -- references -------------------------------------------------------------------------------
    def take(self, group: int, n: int) -> list[int]:
        """``n`` fresh pages of ``group``'s pool, each with one reference the caller now holds (put
        them in a page table, or give them back with ``drop``).

        When the free pages do not cover ``n``, the evictor reclaims first; then a dynamic pool
        grows (at least doubling, within its budget). Raises CacheFull when the pages cannot be
        had (a static pool full, a budgeted one at its budget)."""
        cache, alloc = self.cache, self._allocs[group]
        if n > alloc.num_free and cache.evictor is not None:
            cache.evictor.reclaim(group, n - alloc.num_free)
        if n > alloc.num_free and cache.config.capacity == "dynamic":
            short, grow = n - alloc.num_free, room(cache.config, cache.pools, group)
            extra = max(alloc.total, short)
            if grow is not None:
                if grow < short:
                    from kvcache.fmt import human_bytes

                    raise CacheFull(f"KV cache budget of {human_bytes(cache.config.budget or 0)} is used up "
                                    f"(--kv-budget): need {short} more pages, room for {grow}")
                extra = min(extra, grow)
            cache.pools[group].resize(cache.pools[group].num_pages + extra)
            alloc.grow(extra)
        return alloc.allocate(n)

    def share(self, group: int, pages: Iterable[int]) -> None:
        """One more reference to each page (holes skipped): a fork, or the prefix index keeping it."""
        self._allocs[group].incref([p for p in pages if p != HOLE])

    def drop(self, group: int, pages: Iterable[int]) -> None:
        """One reference less to each page (holes skipped); a page nobody holds is free again."""
        self._allocs[group].release([p for p in pages if p != HOLE])

    # -- pool sizes -------------------------------------------------------------------------------
    def fit(self, pages: int) -> None:
        """Cut every (still empty) pool to ``pages`` pages: a dynamic pool's first size under a budget."""
        for pool, alloc in zip(self.cache.pools, self._allocs):
            pool.resize(pages, sparse=True)  # still the room to grow into (PagePool's sparse_start)
            alloc.truncate(pages)

    def shrink(self, floor: int) -> None:
        """Each group's pages in use move to the lowest ids (page tables and the evictor follow)
        and the pool is cut to them, never below ``floor`` pages."""
        cache = self.cache
        for g in cache.groups:
            alloc, pool = self._allocs[g.index], cache.pools[g.index]
            keep = max(floor, alloc.num_referenced)
            if keep >= alloc.total:
                continue
            moves = alloc.compact(keep)  # old id -> new id, counts moved
            for src, dst in moves.items():
                pool.copy_page(src, dst)
            for seq in cache.sequences.values():
                seq.tables[g.index] = [moves.get(p, p) for p in seq.tables[g.index]]
            if moves and cache.evictor is not None:
                cache.evictor.remap(g.index, moves)
            alloc.truncate(keep)
            pool.resize(keep)

    # -- a step's pages ---------------------------------------------------------------------------
    def ask(self, seqs: Sequence[SeqKV], new_tokens: Sequence[int]) -> Reservation | Refusal:
        """The pages for ``new_tokens[i]`` more tokens of every ``seqs[i]``, or a Refusal (and
        nothing taken). The forward that follows finds them in place: ``reserve_all`` takes
        nothing more for a sequence with pages pending and reports its tables from before the ask.
        Asking again before a forward first gives back what the earlier ask took."""
        for seq in seqs:
            self.cancel(seq)
        try:
            before = self.reserve_all(seqs, new_tokens)
        except CacheFull as e:
            return Refusal("full", str(e))
        except ContextOverflow as e:
            return Refusal("context", str(e))
        for seq, lens in zip(seqs, before):
            seq.pending = lens
        return Reservation(self, list(seqs))

    def commit(self, seqs: Sequence[SeqKV]) -> None:
        """A forward has written the new tokens into the pages asked for: nothing is pending."""
        for seq in seqs:
            seq.pending = None

    def cancel(self, seq: SeqKV) -> None:
        """Pages asked for a step that did not run go back (nothing when none are pending)."""
        if seq.pending is not None:
            self.unreserve(seq, seq.pending)

    def reserve(self, seq: SeqKV, new_tokens: int) -> None:
        """Give ``seq`` the pages for ``new_tokens`` more tokens (all groups, or none on overflow).
        Asking again for the same tokens takes nothing more."""
        cache = self.cache
        total = seq.length + new_tokens
        cap = capacity_per_sequence(cache.config, cache.groups, cache.pools)
        if cap is not None and total > cap:
            raise ContextOverflow(
                f"sequence of {total} tokens exceeds the static cache capacity of {cap} tokens "
                "(raise it with --kv static,max_tokens=N)")
        tentative = seq.verifying and seq.press is not None and cache.config.quantized
        if seq.press is not None:
            if new_tokens > 1 and not seq.verifying:
                seq.press.observing = True  # a prompt (or a chat turn) is being read
            retention.settle(cache, seq)
        self.release_dead(seq)
        self._own_last_page(seq)
        before = [len(t) for t in seq.tables]
        try:
            for g in cache.groups:
                upto = seq.held(g.index) + (0 if tentative else new_tokens)
                need = pages_after(cache.config, seq, g.index, upto) - len(seq.tables[g.index])
                if need > 0:
                    seq.tables[g.index].extend(self.take(g.index, need))
        except ContextOverflow:
            self.unreserve(seq, before)
            raise

    def reserve_all(self, seqs: Sequence[SeqKV], new_tokens: Sequence[int]) -> list[list[int]]:
        """``reserve`` for every sequence, or for none: if one fails, what the others got is given
        back (pages asked for earlier too). Returns each sequence's table lengths from before
        (per group). A sequence whose pages were asked for (``ask``) has them: its lengths from
        before the ask are returned and nothing is done again."""
        before = [seq.pending or [len(t) for t in seq.tables] for seq in seqs]
        try:
            for seq, n in zip(seqs, new_tokens):
                if seq.pending is None:
                    self.reserve(seq, n)
        except Exception:
            for seq, lens in zip(seqs, before):
                self.unreserve(seq, lens)
            raise
        return before

    def unreserve(self, seq: SeqKV, table_lens: list[int]) -> None:
        """Give back the pages reserved after each group's table had ``table_lens[g]`` entries."""
        for gi, n in enumerate(table_lens):
            table = seq.tables[gi]
            self.drop(gi, table[n:])
            del table[n:]
        seq.pending = None

    # -- a sequence's pages -----------------------------------------------------------------------
    def release(self, seq: SeqKV) -> None:
        """Drop the sequence's reference to every page it holds; its tables are emptied."""
        for g in self.cache.groups:
            self.drop(g.index, seq.tables[g.index])
            seq.tables[g.index] = []

    def share_tables(self, seq: SeqKV, child: SeqKV) -> None:
        """``child`` holds every page of ``seq`` too (a fork: one more reference each)."""
        for g in self.cache.groups:
            table = seq.tables[g.index]
            self.share(g.index, table)
            child.tables[g.index] = list(table)

    def release_dead(self, seq: SeqKV) -> None:
        """Windowed groups: give back pages no query at ``seq.length`` or later can see."""
        if seq.press is not None:
            retention.release_dead(self.cache, seq)
            return
        ps = self.cache.page_size
        for g in self.cache.groups:
            dead = g.dead_before(seq.length)
            table = seq.tables[g.index]
            first = -(-g.sinks // ps)  # pages holding a sink token stay
            for i in range(first, min(dead // ps, len(table))):
                if table[i] != HOLE:
                    self.drop(g.index, [table[i]])
                    table[i] = HOLE

    def _own_last_page(self, seq: SeqKV) -> None:
        """Copy-on-write: before new tokens go into a partly filled page that another sequence
        also holds, give this sequence its own copy."""
        if self.cache.config.quantized:
            return
        ps = self.cache.page_size
        for g in self.cache.groups:
            held = seq.held(g.index)
            if held % ps:
                self.own_pages(seq, g.index, (held - 1) // ps, (held - 1) // ps + 1)

    def own_pages(self, seq: SeqKV, group: int, first: int, stop: int) -> None:
        """Copy-on-write: pages ``first .. stop - 1`` of the group's table that another holder
        shares become the sequence's own copies."""
        table = seq.tables[group]
        for i in range(first, min(stop, len(table))):
            if table[i] != HOLE and self.shared(group, table[i]):
                (new,) = self.take(group, 1)
                self.cache.pools[group].copy_page(table[i], new)
                self.drop(group, [table[i]])
                table[i] = new
                self.cache.cow_copies += 1

    def truncate(self, seq: SeqKV, length: int) -> None:
        """Forget tokens from ``length`` on; pages no longer needed go back to the pool (a shared
        partial page stays shared until written). Quantized: pages a sequence of ``length`` tokens
        would not have sealed yet are unsealed, their kept part back in the fp32 tail as it was
        dequantized, so the pages held are those of a sequence that never saw the tokens."""
        cache = self.cache
        if not 0 <= length <= seq.length:
            raise ValueError(f"cannot truncate a sequence of {seq.length} tokens to {length}")
        if seq.press is not None:
            retention.truncate(cache, seq, length)
            return
        ps, model = cache.page_size, cache.model
        for g in cache.groups:
            table, pool = seq.tables[g.index], cache.pools[g.index]
            if cache.config.quantized:
                tails = seq.tails[g.index]
                assert tails is not None
                sealed = len(table)
                # sealed pages as a sequence of ``length`` tokens that never held more would have
                keep = min(sealed, max(0, (length - cache.config.residual) // ps))
                if keep == sealed:
                    seq.tails[g.index] = [t[:, :, : length - sealed * ps] for t in tails]
                    continue
                new_tails = []  # the pages unsealed again (as they were dequantized), then the old tail
                for j, t in enumerate(tails):
                    parts = []
                    for i in range(keep, min(sealed, -(-length // ps))):
                        part = torch.zeros(2, model.num_kv_heads, ps, model.head_dim)
                        if table[i] != HOLE:
                            assert isinstance(pool, QuantPool)
                            pool.read_into(j, None, table[i], 1, part)
                        parts.append(part)
                    new_tails.append(torch.cat(parts + [t], dim=2)[:, :, : length - keep * ps].clone())
                seq.tails[g.index] = new_tails
            else:
                keep = -(-length // ps)  # a kept shared partial page is copied when next written
            self.drop(g.index, table[keep:])
            del table[keep:]
        seq.length = length

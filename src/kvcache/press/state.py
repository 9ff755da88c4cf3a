"""One sequence's retention state: which token each slot holds, and what its press recorded.

Per layer group (layers that share page tables), ``pos[g]`` [n_layers, Hkv, cap] int32 gives the
position of the token in each of the sequence's slots, per layer and KV head (-1: evicted, its
slot not yet packed away); the first ``n[g]`` slots are in use. A press evicts per layer and head
but the same number everywhere, so every layer and head of a group uses the same slots. H2O's
accumulated attention sits beside them in ``acc[g]``. ``obs[layer]`` holds what the forwards
recorded since the last compression (press/observe.py). ``since`` is the position the next
prefill-time compression starts from, ``points`` the lengths at which prompts were compressed;
``observing`` is set while a prompt is being read; ``replay`` while the model replays one for
KVzip: (first, end) of the chunk of positions being scored and the prompt's length, the replayed
tokens' largest attention per slot gathering in ``acc`` (press/kvzip.py). ``pending[layer]``: a
verifying forward's attention, per query (speculation): only the queries of tokens kept count,
taken in by ``commit`` once the sequence's length says which were.

Tensors only: the cache (cache/retention.py) moves the K/V, this follows the slots.
"""

from __future__ import annotations

import torch

from kvcache.press.base import Press
from kvcache.press.observe import LayerObservation


class PressState:
    def __init__(self, press: Press, group_layers: list[int], num_layers: int, num_kv_heads: int) -> None:
        self.press = press
        self.hkv = num_kv_heads
        self.pos = [torch.full((n, num_kv_heads, 0), -1, dtype=torch.int32) for n in group_layers]
        self.acc: list[torch.Tensor | None] = [
            torch.zeros(n, num_kv_heads, 0) if press.attention else None for n in group_layers]
        self.n = [0] * len(group_layers)
        self.obs = [LayerObservation() for _ in range(num_layers)]
        self.last: list[torch.Tensor | None] = [None] * num_layers  # TOVA: latest query's weights [Hq, S]
        self.since = 0
        self.points: list[int] = []  # lengths at which a prompt was compressed
        self.released = False  # a window gave pages back (earlier lengths cannot be gone back to)
        self.observing = True
        self.replay: tuple[int, int, int] | None = None
        self.scale = 1.0
        self.rotary: list[object | None] = [None] * num_layers
        # per layer: (group, index in it, query positions [T], per-query sums [Hkv, T, S], per-query
        # weights [Hq, T, S]) of a verifying forward, or None
        self.pending: list[tuple | None] = [None] * num_layers

    # -- slots --------------------------------------------------------------------------------------
    def append(self, g: int, start: int, count: int) -> None:
        """``count`` new tokens at positions start.. take the next slots of group ``g``."""
        n, pos = self.n[g], self.pos[g]
        if n + count > pos.shape[2]:
            cap = max(n + count, pos.shape[2] + pos.shape[2] // 4, 64)  # a quarter more: amortized, little slack
            self.pos[g] = torch.cat((pos, torch.full((*pos.shape[:2], cap - pos.shape[2]), -1, dtype=torch.int32)), 2)
            acc = self.acc[g]
            if acc is not None:
                self.acc[g] = torch.cat((acc, torch.zeros(*acc.shape[:2], cap - acc.shape[2])), 2)
        self.pos[g][:, :, n : n + count] = torch.arange(start, start + count, dtype=torch.int32)
        acc = self.acc[g]
        if acc is not None:
            acc[:, :, n : n + count] = 0
        self.n[g] = n + count

    def positions(self, g: int, j: int) -> torch.Tensor:
        """[Hkv, S] int64: layer j's (index in its group) slots."""
        return self.pos[g][j, :, : self.n[g]].long()

    def masked(self, g: int) -> int:
        """Slots of group ``g`` evicted but not packed away (the same count in every layer and head)."""
        return int((self.pos[g][0, 0, : self.n[g]] < 0).sum())

    def keep(self, g: int, idx: torch.Tensor) -> None:
        """Keep only slots ``idx`` ([n_layers, Hkv, m] int64, increasing) of group g, packed to the front."""
        m = idx.shape[2]
        cap = min(self.pos[g].shape[2], max(64, m + m // 8))  # what was packed away is given back too
        pos = torch.full((*idx.shape[:2], cap), -1, dtype=torch.int32)
        pos[:, :, :m] = torch.gather(self.pos[g][:, :, : self.n[g]], 2, idx)
        self.pos[g] = pos
        acc = self.acc[g]
        if acc is not None:
            new = torch.zeros(self.pos[g].shape)
            new[:, :, :m] = torch.gather(acc[:, :, : self.n[g]], 2, idx)
            self.acc[g] = new
        self.n[g] = m

    def cut(self, g: int, a: int, b: int) -> None:
        """Remove slots a .. b - 1 of group g (every layer and head), the later ones moving down."""
        n = self.n[g]
        self.pos[g][:, :, a : n - (b - a)] = self.pos[g][:, :, b:n].clone()
        self.pos[g][:, :, n - (b - a) : n] = -1
        acc = self.acc[g]
        if acc is not None:
            acc[:, :, a : n - (b - a)] = acc[:, :, b:n].clone()
        self.n[g] = n - (b - a)

    def truncate(self, g: int, m: int) -> None:
        """Forget slots from ``m`` on."""
        self.pos[g][:, :, m : self.n[g]] = -1
        self.n[g] = m

    @torch.inference_mode()
    def commit(self, length: int) -> None:
        """A verifying forward's attention, for the queries of the tokens the sequence kept (its
        positions below ``length``), in order as one-token decodes would have added it: H2O's sums
        take each kept query's, TOVA's latest weights are the last kept query's. Refused tokens'
        queries never count."""
        for layer, p in enumerate(self.pending):
            if p is None:
                continue
            g, j, q_pos, rows, lasts = p
            k = int((q_pos < length).sum())
            acc, s = self.acc[g], min(rows.shape[2], self.n[g])
            if acc is not None:
                for r in range(k):
                    acc[j, :, :s] += rows[:, r, :s]
            if k and self.press.decode:
                self.last[layer] = lasts[:, k - 1, : self.n[g]]
            self.pending[layer] = None

    def nbytes(self) -> int:
        """Bytes this state holds beside the K/V (slot positions, accumulated attention)."""
        total = sum(p.numel() * p.element_size() for p in self.pos)
        return total + sum(a.numel() * a.element_size() for a in self.acc if a is not None)

    def start_replay(self) -> None:
        """Room for the replay's scores beside every slot (KVzip)."""
        self.acc = [torch.zeros(p.shape) for p in self.pos]

    def end_replay(self) -> None:
        self.replay = None
        if not self.press.attention:
            self.acc = [None] * len(self.acc)

    def reset_observations(self) -> None:
        for o in self.obs:
            o.reset()
        self.last = [None] * len(self.last)

    def clone(self) -> "PressState":
        out = PressState.__new__(PressState)
        out.press, out.hkv, out.since, out.observing = self.press, self.hkv, self.since, self.observing
        out.points, out.released = list(self.points), self.released
        out.pos = [p.clone() for p in self.pos]
        out.acc = [None if a is None else a.clone() for a in self.acc]
        out.n = list(self.n)
        out.obs = [o.clone() for o in self.obs]
        out.last = [None if t is None else t.clone() for t in self.last]
        out.scale, out.rotary, out.replay = self.scale, list(self.rotary), self.replay
        out.pending = list(self.pending)  # read only: commit replaces entries, never writes into them
        return out

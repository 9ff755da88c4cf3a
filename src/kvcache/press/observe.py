"""What the forwards record for a press, per layer of one sequence, between two compressions.

- the latest ``w`` queries of the prompt (RoPE applied, with their positions): SnapKV's window,
  TOVA's last token;
- the mean and covariance of the prompt's queries before RoPE (running sums in float64, every
  position from ``first`` on): expected attention;

(H2O's attention received by each slot is kept by the cache beside the slots, since it moves
with them when they are packed.)
"""

from __future__ import annotations

import torch


class LayerObservation:
    __slots__ = ("queries", "q_pos", "q_sum", "q_outer", "q_count")

    def __init__(self) -> None:
        self.queries: torch.Tensor | None = None  # [Hq, w, D] latest queries, oldest first
        self.q_pos: torch.Tensor | None = None  # [w] int64
        self.q_sum: torch.Tensor | None = None  # [Hq, D] float64, pre-RoPE queries summed
        self.q_outer: torch.Tensor | None = None  # [Hq, D, D] float64, their outer products summed
        self.q_count = 0

    def record_queries(self, q: torch.Tensor, q_pos: torch.Tensor, keep: int) -> None:
        """q: [T, Hq, D] post-RoPE; q_pos: [T]. Keeps the latest ``keep``."""
        q = q.transpose(0, 1)[:, -keep:]  # [Hq, t, D]
        q_pos = q_pos[-keep:]
        if self.queries is not None:
            q = torch.cat((self.queries, q), 1)[:, -keep:]
            q_pos = torch.cat((self.q_pos, q_pos))[-keep:]  # type: ignore[arg-type]
        self.queries, self.q_pos = q.contiguous().clone(), q_pos.clone()

    def record_moments(self, q_pre: torch.Tensor) -> None:
        """q_pre: [T, Hq, D] queries before RoPE (the rows to count)."""
        if not q_pre.shape[0]:
            return
        x = q_pre.double().transpose(0, 1)  # [Hq, T, D]
        s, o = x.sum(1), torch.matmul(x.transpose(1, 2), x)  # [Hq, D], [Hq, D, D]
        if self.q_sum is None:
            self.q_sum, self.q_outer = s, o
        else:
            self.q_sum += s
            self.q_outer += o  # type: ignore[operator]
        self.q_count += q_pre.shape[0]

    def mean_cov(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries' mean [Hq, D] and covariance [Hq, D, D] (divided by the count), float32."""
        if self.q_sum is None or not self.q_count:
            raise ValueError("no queries were recorded for expected attention")
        mu = self.q_sum / self.q_count
        cov = self.q_outer / self.q_count - mu[:, :, None] * mu[:, None, :]  # type: ignore[operator]
        return mu.float(), cov.float()

    def reset(self) -> None:
        """A compression used them: start again for the next span."""
        self.queries = self.q_pos = self.q_sum = self.q_outer = None
        self.q_count = 0

    def clone(self) -> "LayerObservation":
        out = LayerObservation()
        for name in ("queries", "q_pos", "q_sum", "q_outer"):
            t = getattr(self, name)
            setattr(out, name, None if t is None else t.clone())
        out.q_count = self.q_count
        return out

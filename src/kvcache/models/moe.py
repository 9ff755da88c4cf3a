"""Mixture-of-experts feed-forward blocks: the router, the experts, and one step's rows grouped by
expert.

``MoeSpec`` reads a sparse model's hyper-parameters from its HF config and refuses the variants this
code does not implement. ``Router`` holds the router matrix (always fp32: a routing decision is
discrete, and llama.cpp keeps it unquantized too) and, from a layer's residual rows, makes the rows
the experts read (the post-attention RMSNorm) and picks each row's experts: a softmax over the
router logits in fp32, the top k of it, renormalized to sum to one when the config says so. With
the native library (kernels/dmoe.c) every row takes one written order, alone or in a batch; a
decode row's whole block (norm, router, experts, residual) is then one native call.
``Expert`` is one gated MLP (gate and up fused into one projection, then down), its matrices held
as ``projection`` gives them (packed fp32, or a QWeight in the file's own quantized type).

``moe_block`` runs a step: rows are grouped by the expert they chose, each expert's weights are
read once for all of its rows, and every row sums its experts' outputs in its own order (the
router gives a row's experts in increasing id order; the experts run in that order, so a row's sum
is built as its experts come, with one expert's outputs held at a time).
Nothing a row computes depends on which other rows chose the same expert or on how many rows the
step has: the products reduce each output element in one fixed order whatever their row count
(kernels/pgemm.c, kernels/qgemm.c), and the combination is element-wise in a fixed order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from kvcache.errors import UnsupportedArchitecture
from kvcache.kernels.qmoe import expert_table, moe_row, moe_rows, route, router_table
from kvcache.kernels.qweight import expert_mlp
from kvcache.models.config import ModelConfig
from kvcache.models.layers import frozen, linear, pack, rms_norm
from kvcache.models.weights import Part, as_fp32, projection


@dataclass(frozen=True)
class MoeSpec:
    """The sparse feed-forward's hyper-parameters."""

    num_experts: int
    top_k: int  # experts per token
    expert_size: int  # each expert's intermediate size
    norm_topk: bool  # renormalize the chosen experts' weights to sum to one

    @classmethod
    def of(cls, config: ModelConfig) -> "MoeSpec":
        """Read from ``config.raw``; UnsupportedArchitecture (one line) for what is not implemented."""
        raw, mt = config.raw, config.model_type

        def refuse(what: str) -> UnsupportedArchitecture:
            return UnsupportedArchitecture(f"{mt}: {what} is not supported")

        if raw.get("mlp_only_layers"):
            raise refuse(f"dense MLP layers among the sparse ones (mlp_only_layers={list(raw['mlp_only_layers'])})")
        if int(raw.get("decoder_sparse_step", 1)) != 1:
            raise refuse(f"sparse layers every {raw['decoder_sparse_step']} layers (decoder_sparse_step)")
        if int(raw.get("shared_expert_intermediate_size") or 0) > 0 or raw.get("n_shared_experts"):
            raise refuse("a shared expert")
        if raw.get("use_sliding_window"):
            raise refuse("sliding-window attention (use_sliding_window)")
        mixtral = mt in ("mixtral", "gpt_oss")  # the chosen weights renormalised (gpt-oss: a softmax over the k)
        try:  # transformers 5 writes num_experts as num_local_experts
            n = int(raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"])
            k = int(raw["num_experts_per_tok"])
            if mt in ("mixtral", "olmoe", "gpt_oss"):  # each expert as wide as intermediate_size
                size = int(raw.get("moe_intermediate_size") or raw["intermediate_size"])
            else:
                size = int(raw["moe_intermediate_size"])
        except KeyError as e:
            raise UnsupportedArchitecture(f"{mt}: config.json lacks {e.args[0]!r}") from None
        if not 1 <= k <= n or size < 1:
            raise refuse(f"{k} experts per token of {n} (moe_intermediate_size {size})")
        return cls(n, k, size, mixtral or bool(raw.get("norm_topk_prob", False)))


class Router(nn.Module):
    """Top-k routing over ``num_experts`` experts, after the post-attention RMSNorm of weight
    ``norm`` (the rows it gives are what the experts read)."""

    def __init__(self, weight: Part, norm: torch.Tensor, eps: float, spec: MoeSpec) -> None:
        super().__init__()
        w = as_fp32(weight)  # [E, H]
        if w.shape[0] != spec.num_experts:
            raise UnsupportedArchitecture(f"a router of {w.shape[0]} experts where the config has {spec.num_experts}")
        self.norm, self.eps = norm, eps  # [H]
        table = router_table(w)  # [H, Ep]: the native calls' layout, or None without the library
        self.table = None if table is None else frozen(table)
        self.weight = pack(w) if table is None else None  # [k, H, E / k]: torch's way
        self.spec = spec

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[override]
        """x [N, H] (the residual rows) -> (h [N, H] normed, weights [N, K] fp32, experts [N, K] int64),
        a row's chosen experts in increasing id order (the order every sum over them takes)."""
        spec = self.spec
        if self.table is not None:
            return route(x, self.norm, self.eps, self.table, spec.num_experts, spec.top_k, spec.norm_topk)
        h = rms_norm(x, self.norm, self.eps)
        logits = linear(h, self.weight)[:, : spec.num_experts].contiguous()  # [N, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [N, E]
        weights, experts = torch.topk(probs, spec.top_k, dim=-1)  # [N, K] each
        experts, order = torch.sort(experts, dim=-1)  # a row's experts in increasing id order, as the native router's
        weights = weights.gather(1, order)
        if spec.norm_topk:
            total = weights[:, 0].clone()  # [N]: the chosen weights summed in that order
            for j in range(1, spec.top_k):
                total += weights[:, j]
            weights = weights / total[:, None]
        return h, weights, experts


class Expert(nn.Module):
    """One expert: down(act(gate(h)) * up(h)), gate and up fused into one projection."""

    def __init__(self, gate_up: list[Part], down: Part, mode: str, size: int, act_kernel: int | None = None) -> None:
        super().__init__()
        self.size = size
        self.gate_up = projection(gate_up, None, mode)  # [k, H, 2I / k] packed, or a QWeight [2I, H]
        self.down = projection([down], None, mode)  # [k, I, H / k] packed, or a QWeight [H, I]
        self.act_kernel = act_kernel  # the activation's id in the native kernels (layers.ACT_KERNEL), or None

    def forward(self, h: torch.Tensor,  # type: ignore[override]
                act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """h [n, H] -> [n, H]. Quantized weights: one native call (gate_up, the activation, down),
        whatever the number of rows; fp32 ones: the packed products and torch's activation."""
        y = expert_mlp(h, self.gate_up, self.down, self.act_kernel)  # [n, H] or None
        if y is not None:
            return y
        i = self.size
        gu = linear(h, self.gate_up)  # [n, 2I (padded)]
        a = act(gu[:, :i]).mul_(gu[:, i : 2 * i])  # [n, I]
        return linear(a, self.down)[:, : h.shape[1]]  # [n, H]


def expert_parts(sd: dict[str, Any], m: str, spec: MoeSpec) -> list[tuple[list[Part], Part]]:
    """Per expert, ([gate, up] or [gate_up], down) weights of the block under prefix ``m``
    (``model.layers.{i}.mlp``): per-expert matrices as a checkpoint on disk names them
    (``experts.{e}.gate_proj.weight`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I]), or the
    stacked ones transformers holds in memory (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]). KeyError names a missing tensor."""
    n, i = spec.num_experts, spec.expert_size
    if any(k.startswith(f"{m}.shared_expert") for k in sd):
        raise UnsupportedArchitecture(f"{m}: a shared expert is not supported")
    if f"{m}.experts.gate_up_proj" in sd:
        gu, dn = sd[f"{m}.experts.gate_up_proj"], sd[f"{m}.experts.down_proj"]  # [E, 2I, H], [E, H, I]
        if gu.shape[0] != n or gu.shape[1] != 2 * i or dn.shape[0] != n or dn.shape[2] != i:
            raise UnsupportedArchitecture(f"{m}: stacked experts of shape {tuple(gu.shape)} / {tuple(dn.shape)} do "
                                          f"not fit {n} experts of size {i}")
        return [([gu[e]], dn[e]) for e in range(n)]
    if f"{m}.experts.{n}.gate_proj.weight" in sd:
        raise UnsupportedArchitecture(f"{m}: the weights hold more experts than the config's {n}")
    out = []
    for e in range(n):
        p = f"{m}.experts.{e}"
        gate, up, down = sd[f"{p}.gate_proj.weight"], sd[f"{p}.up_proj.weight"], sd[f"{p}.down_proj.weight"]
        if gate.shape[0] != i or up.shape[0] != i or down.shape[1] != i:
            raise UnsupportedArchitecture(f"{p}: expert matrices of {gate.shape[0]} rows where the config has {i}")
        out.append(([gate, up], down))
    return out


def moe_block(x: torch.Tensor, router: Router, experts: nn.ModuleList,
              act: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """x [N, H] += sum over each row's chosen experts e_j (j in the router's id order) of w_j * e_j(h), with
    h [N, H] the normed rows (``router``'s) the experts read. Rows are grouped by expert: each
    chosen expert runs once, over all the rows that chose it. A single row (a decode step) runs its
    experts in that order and sums them as the grouped path does: the same bits. Quantized
    experts run in one native call a layer (with the native router, a decode row's norm and routing
    too), without torch's steps between the experts or buffers of the allocator's."""
    n, hidden = x.shape
    kept = experts.__dict__.get("_row_table")
    if kept is None:  # every expert's native fields and the activation's kernel, made once
        kept = experts.__dict__["_row_table"] = (expert_table([(ex.gate_up, ex.down) for ex in experts]),
                                                 experts[0].act_kernel)
    table, act_kernel = kept  # table None: some expert is not quantized
    if n == 1:  # a decode step: the row's experts in their order, no grouping to do
        spec = router.spec
        if (table is not None and router.table is not None
                and moe_row(x, router.norm, router.eps, router.table, spec.num_experts, spec.top_k, spec.norm_topk,
                            table, act_kernel)):
            return
        h, weights, chosen = router(x)  # fp32 experts (or no library): the experts one by one
        out = None
        for j, e in enumerate(chosen[0].tolist()):
            y = experts[e](h, act) * weights[:, j : j + 1]  # [1, H]
            out = y if out is None else out.add_(y)
        x += out
        return
    h, weights, chosen = router(x)  # [N, H], [N, K] each
    if table is not None and moe_rows(x, h, weights, chosen, table, act_kernel):  # quantized experts: one call
        return
    k = weights.shape[1]
    flat = chosen.reshape(-1)  # [N K]: slot r * K + j is row r's j-th choice
    order = torch.argsort(flat, stable=True)  # [N K] slots grouped by expert, in increasing id order
    used, counts = torch.unique_consecutive(flat[order], return_counts=True)  # the chosen experts only
    rows = torch.div(order, k, rounding_mode="floor")  # [N K]: the row of each grouped slot
    first = order % k == 0  # a row's first term: its lowest expert id, so the first of its experts to run
    w = weights.reshape(-1)
    out = torch.empty(n, hidden)  # each row's sum so far, built as its experts come
    start = 0
    for e, c in zip(used.tolist(), counts.tolist()):
        at = slice(start, start + c)
        r = rows[at]
        t = experts[e](h.index_select(0, r), act) * w[order[at]][:, None]  # [c, H]
        f = first[at]
        out.index_copy_(0, r[f], t[f])
        out.index_add_(0, r[~f], t[~f])  # a row chose this expert once: one add to its sum
        start += c
    x += out

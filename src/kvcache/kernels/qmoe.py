"""The mixture-of-experts calls of the native kernels (kernels/dmoe.c, in the qgemm library).

``router_table`` lays a router matrix out once for them; ``route`` runs the post-attention norm,
the router's logits, each row's top k and its weights for any number of rows (every row alone: its
results never depend on the others, and the decode call below takes the same steps);
``expert_table`` holds every expert's fields of a layer, made once; ``experts_row`` sums one row's
chosen experts; ``moe_row`` does a decode row's whole sparse half (norm, router, experts, residual)
in one call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache import kernels
from kvcache.kernels.qweight import _lib, _projection, _vector_ptr

PAD = 16  # the router table's columns: a multiple of every variant's vector width
MAX_K = 32  # experts a row (dmoe.c's KMAX)


def router_table(w: torch.Tensor) -> torch.Tensor | None:
    """The router matrix w [E, H] as the native calls read it: transposed, its columns padded with
    zeros to a multiple of 16 -> [H, Ep] fp32; None when the native library is not there."""
    if kernels.qgemm() is None:
        return None
    e, h = w.shape
    ep = -(-e // PAD) * PAD
    out = torch.zeros(h, ep, dtype=torch.float32)
    out[:, :e] = w.detach().to(torch.float32).t()
    return out


def _checked(rc: int, what: str) -> None:
    if rc == 4:
        raise MemoryError(f"the {what} could not allocate its buffers")
    if rc:
        raise RuntimeError(f"the {what} kernel refused its inputs ({rc})")


def route(x: torch.Tensor, post_norm: torch.Tensor, eps: float, table: torch.Tensor, num_experts: int, k: int,
          norm: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, H] -> (h [N, H] the normed rows, weights [N, k] fp32, experts [N, k] int64: a row's top k
    in increasing expert id order)."""
    n, hidden = x.shape
    if x.dtype != torch.float32 or x.stride(1) != 1 or table.shape[0] != hidden or not 1 <= k <= min(MAX_K, num_experts):
        raise ValueError(f"the router takes fp32 rows of {table.shape[0]} and 1..{MAX_K} experts a row")
    h = torch.empty(n, hidden)
    w = torch.empty(n, k)
    e = torch.empty(n, k, dtype=torch.int64)
    rc = _lib().kv_moe_route(n, hidden, x.data_ptr(), x.stride(0), _vector_ptr(post_norm, hidden, "norm weight"), eps,
                             table.data_ptr(), num_experts, table.shape[1], k, int(norm), h.data_ptr(), w.data_ptr(),
                             e.data_ptr(), torch.get_num_threads())
    _checked(rc, "router")
    return h, w, e


def expert_table(experts: Sequence[tuple[object, object]],
                 biases: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """Every expert's (gate_up, down) fields as the native calls take them, made once for a layer:
    ([E, KVP_N] int64 gate_up fields, [E, KVP_N] down fields, the hidden size, the expert size), or
    None when some expert is not quantized in a form the native calls take. ``biases``: each
    expert's (gate_up bias, down bias) (gpt-oss's), held by the caller as long as the table."""
    gus, dns = [], []
    for i, (gate_up, down) in enumerate(experts):
        gb, db = biases[i] if biases is not None else (None, None)
        (pg, gu), (pd, dn) = _projection(gate_up, gb), _projection(down, db)
        if (gu is None or dn is None or len(pd) != 1 or down.out != gate_up.k  # type: ignore[attr-defined]
                or 2 * down.k != gate_up.out):  # type: ignore[attr-defined]
            return None
        gus.append(gu)
        dns.append(dn)
    if not gus or len({(g.k, d.k) for g, d in experts}) != 1:  # type: ignore[attr-defined]
        return None
    return torch.stack(gus), torch.stack(dns), experts[0][0].k, experts[0][1].k  # type: ignore[attr-defined]


def experts_row(h: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor, int, int], chosen: torch.Tensor,
                weights: torch.Tensor, act: int | None) -> torch.Tensor | None:
    """One row's mixture in one native call (kernels/dmoe.c kv_q_experts_row): sum over j of
    weights[j] * expert_{chosen[j]}(h), h [1, H], ``table`` the layer's ``expert_table``, chosen
    [k] int64 expert ids in the row's order, weights [k] fp32 -> [1, H]; the bits of ``expert_mlp``
    per expert combined by separate multiplies and adds in that order. None: not done here (no
    activation kernel, a row of another shape, more than 32 experts)."""
    gu_all, dn_all, hidden, size = table
    if (act is None or h.shape != (1, hidden) or h.dtype != torch.float32 or not h.is_contiguous()
            or not 1 <= chosen.numel() <= MAX_K):
        return None
    idx = chosen.to(torch.int64)
    try:  # [k, KVP_N] each, in the row's order; index_select checks every id
        gu, dn = gu_all.index_select(0, idx), dn_all.index_select(0, idx)
    except (IndexError, RuntimeError):
        raise IndexError(f"an expert id outside the layer's {gu_all.shape[0]} experts") from None
    w = weights.to(torch.float32).contiguous()
    out = torch.empty(1, hidden)
    rc = _lib().kv_q_experts_row(hidden, size, h.data_ptr(), idx.numel(), gu.data_ptr(), dn.data_ptr(),
                                 w.data_ptr(), act, out.data_ptr(), torch.get_num_threads())
    _checked(rc, "quantized experts")
    return out


def moe_row(x: torch.Tensor, post_norm: torch.Tensor, eps: float, router: torch.Tensor, num_experts: int, k: int,
            norm: bool, table: tuple[torch.Tensor, torch.Tensor, int, int], act: int | None) -> bool:
    """x [1, H] += the mixture of its chosen experts, in one native call (kv_q_moe_row: ``route``'s
    steps, then ``experts_row``'s, so the same bits); ``router`` the layer's ``router_table``.
    False: not done here (nothing changed)."""
    gu_all, dn_all, hidden, size = table
    if (act is None or x.shape != (1, hidden) or x.dtype != torch.float32 or not x.is_contiguous()
            or gu_all.shape[0] != num_experts or router.shape[0] != hidden or not 1 <= k <= min(MAX_K, num_experts)):
        return False
    w = torch.empty(k)
    e = torch.empty(k, dtype=torch.int64)
    rc = _lib().kv_q_moe_row(hidden, size, x.data_ptr(), _vector_ptr(post_norm, hidden, "norm weight"), eps,
                             router.data_ptr(), num_experts, router.shape[1], k, int(norm), gu_all.data_ptr(),
                             dn_all.data_ptr(), act, w.data_ptr(), e.data_ptr(), torch.get_num_threads())
    _checked(rc, "mixture")
    return True


def moe_rows(x: torch.Tensor, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
             table: tuple[torch.Tensor, torch.Tensor, int, int], act: int | None) -> bool:
    """x [N, H] += each row's mixture of its chosen experts (``route``'s h [N, H], weights and
    experts [N, k]) in one native call (kv_q_moe_rows): every chosen expert once over the rows that
    chose it, a row's result its own bits (those of ``moe_row`` for that row). False: not done here
    (nothing changed)."""
    gu_all, dn_all, hidden, size = table
    n, k = experts.shape
    if (act is None or x.dtype != torch.float32 or x.dim() != 2 or x.shape != (n, hidden) or x.stride(1) != 1
            or h.shape != (n, hidden) or not h.is_contiguous() or weights.shape != (n, k) or not 1 <= k <= MAX_K):
        return False
    w = weights.to(torch.float32).contiguous()
    e = experts.to(torch.int64).contiguous()
    rc = _lib().kv_q_moe_rows(n, hidden, size, x.data_ptr(), x.stride(0), h.data_ptr(), w.data_ptr(), e.data_ptr(),
                              k, gu_all.shape[0], gu_all.data_ptr(), dn_all.data_ptr(), act, torch.get_num_threads())
    if rc == 1:
        raise IndexError(f"an expert id outside the layer's {gu_all.shape[0]} experts, a row's ids not in increasing "
                         "order, or experts that do not fit")
    _checked(rc, "mixture")
    return True

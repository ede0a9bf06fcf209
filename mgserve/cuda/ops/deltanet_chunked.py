"""The chunked gated delta rule of one session's prompt, reorganised for a GPU
(``delta_rule_chunked_device``): the same chunk boundaries and algebra as
``mgserve.core.reference.deltanet.delta_rule_chunked``, in few, large ops (prefill is bound by the
host's launch rate otherwise)."""

from __future__ import annotations

import torch

_PREFILL_ELEMS = 1 << 25  # bound on H * chunks * chunk^2 of one batched block


def _chunk_major(x: torch.Tensor, n_chunks: int, chunk: int) -> torch.Tensor:
    """[T, H, ...] -> [n_chunks, H, chunk, ...] contiguous, zero-padded at the end."""
    pad = n_chunks * chunk - x.shape[0]
    if pad:
        x = torch.cat((x, x.new_zeros((pad, *x.shape[1:]))))
    return x.view(n_chunks, chunk, *x.shape[1:]).transpose(1, 2).contiguous()


def delta_rule_chunked_device(
    q: torch.Tensor,  # [T, H, d_k] L2-normed and scaled
    k: torch.Tensor,  # [T, H, d_k] L2-normed
    v: torch.Tensor,  # [T, H, d_v]
    g: torch.Tensor,  # [T, H] log decay
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [H, d_k, d_v]
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, H, d_v], new state [H, d_k, d_v]
    """``deltanet.delta_rule_chunked`` for one session, on the tensors' device.

    Same chunk boundaries and algebra, reorganised so that a GPU runs few, large ops (prefill is
    bound by the host's launch rate otherwise). Everything that does not depend on the entering
    state is computed for a whole block of chunks at once (``_PREFILL_ELEMS`` bounds its size;
    a 4096-token prompt is one block): the decays, one batched unit-triangular solve for both
    right-hand sides, q k^T. Per chunk i, with Z_i = [V_i; S_i] ([C + d_k, d_v]: the chunk's
    corrected values over its entering state), only two products remain::

        V_i = U_i - W_i S_i                    (one in-place baddbmm)
        S_{i+1} = [K_i | keep_i I] Z_i         (one bmm: the state decay rides in the product)

    and the outputs of every chunk are one product afterwards: O_i = [A_i | Q_i] Z_i.
    Cumulative log decays are summed in float64, so exp(G_i - G_j) stays accurate for long
    chunks with strong decay (only differences <= 0 are exponentiated: nothing overflows).
    The last chunk is zero-padded (g = 0, beta = 0, k = q = v = 0), which changes nothing: padded
    rows write nothing and read nothing, and a zero log decay keeps the state."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    t, h, dk = k.shape
    dv = v.shape[-1]
    dev, dt = q.device, state.dtype
    n_chunks = -(-t // chunk)
    qb, kb, vb, gb, bb = (_chunk_major(x, n_chunks, chunk) for x in (q, k, v, g, beta))
    # qb, kb [n, H, C, d_k], vb [n, H, C, d_v], gb, bb [n, H, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).tril()  # [C, C] j <= i
    outs = torch.empty(n_chunks, h, chunk, dv, dtype=dt, device=dev)  # [n, H, C, d_v]
    group = max(1, _PREFILL_ELEMS // (h * chunk * chunk))  # chunks per batched block
    for c0 in range(0, n_chunks, group):
        sl = slice(c0, c0 + group)
        qc, kc, vc, bc = qb[sl], kb[sl], vb[sl], bb[sl]
        m = qc.shape[0]  # chunks in this block
        cum64 = gb[sl].double().cumsum(-1)  # [m, H, C] log decay from chunk start to i
        diff = (cum64[..., :, None] - cum64[..., None, :]).to(dt)  # [m, H, C, C]
        decay = diff.masked_fill_(~causal, -torch.inf).exp_()  # exp(G_i - G_j), 0 for j > i
        cum = cum64.to(dt)
        e_cum = cum.exp()[..., None]  # [m, H, C, 1]
        # Row i of the UT system: beta_i k_i . k_j decay[i, j] for j < i. The solve reads only
        # the strict lower triangle (ones assumed on the diagonal), so no tril / eye is needed.
        system = (kc @ kc.transpose(-1, -2)).mul_(decay).mul_(bc[..., None])  # [m, H, C, C]
        rhs = torch.cat((vc, kc * e_cum), dim=-1).mul_(bc[..., None])  # [m, H, C, d_v + d_k]
        sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u, w = sol[..., :dv], sol[..., dv:]  # [m, H, C, d_v] values, [m, H, C, d_k] state cancel
        aq = torch.cat(((qc @ kc.transpose(-1, -2)).mul_(decay), qc * e_cum), dim=-1)
        # aq [m, H, C, C + d_k]: [intra-chunk attention | reads of the entering state]
        to_end = (cum64[..., -1:] - cum64).to(dt).exp_()  # [m, H, C] exp(G_last - G_i)
        kp = torch.zeros(m, h, dk, chunk + dk, dtype=dt, device=dev)  # [m, H, d_k, C + d_k]
        kp[..., :chunk] = (kc * to_end[..., None]).transpose(-1, -2)
        kp[..., chunk:].diagonal(dim1=-2, dim2=-1).copy_(cum[..., -1:].exp().expand(m, h, dk))
        z = torch.empty(m + 1, h, chunk + dk, dv, dtype=dt, device=dev)  # [m + 1, H, C + d_k, d_v]
        z[:m, :, :chunk] = u
        z[0, :, chunk:] = state
        # per-chunk views made up front (one unbind each, not a few views per chunk)
        zs, vs, ss = z.unbind(0), z[:, :, :chunk].unbind(0), z[:, :, chunk:].unbind(0)
        for wi, kpi, i in zip(w.unbind(0), kp.unbind(0), range(m), strict=True):
            vs[i].baddbmm_(wi, ss[i], alpha=-1)  # V_i = U_i - W_i S_i
            torch.bmm(kpi, zs[i], out=ss[i + 1])  # S_{i+1}
        torch.bmm(
            aq.view(m * h, chunk, chunk + dk),
            z[:m].view(m * h, chunk + dk, dv),
            out=outs[sl].view(m * h, chunk, dv),
        )
        state = z[m, :, chunk:]
    o = outs.transpose(1, 2).reshape(n_chunks * chunk, h, dv)[:t]  # [T, H, d_v]
    return o, state.contiguous()

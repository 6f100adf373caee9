"""A loop-level reference Evoformer (Jumper et al., 2021, supplementary Algorithms 6-15), written
from the algorithm text and not from ``cfx._src.models.evoformer``: every sum and every attention is
an explicit Python loop over sequences, residues, heads and the summed index; only position-wise
ops (LayerNorm, Linear, sigmoid) act on whole tensors.

It takes the library layers' params dicts and works on ONE example: ``m`` ``(S, R, c_m)``, ``z``
``(R, R, c_z)``, ``msa_mask`` ``(S, R)`` and ``pair_mask`` ``(R, R)`` (bool or 0/1; None = all real);
:func:`evoformer` alone loops over leading batch dims. Every layer returns its UPDATE (the block
adds the residual). Slow by design: for tiny sizes only.
"""
from __future__ import annotations

import math

import torch

LN_EPS = 1e-5           # every LayerNorm
OPM_EPS = 1e-3          # the outer product mean's denominator
MASKED_LOGIT = -1e9     # a masked key's logit (set, not added)


# -- position-wise pieces ----------------------------------------------------------------------------
def linear(p: dict, x: torch.Tensor) -> torch.Tensor:
    """``x @ w + b`` (no ``b``: bias-free), over the last dim."""
    y = x @ p["w"]
    return y + p["b"] if "b" in p else y


def layer_norm(p: dict, x: torch.Tensor) -> torch.Tensor:
    """Biased variance over the last dim, eps 1e-5, then ``scale`` and ``bias``."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + LN_EPS) * p["scale"] + p["bias"]


def _bools(mask: torch.Tensor | None, shape: tuple) -> list:
    """``mask`` as nested Python lists of bools (None: all True)."""
    if mask is None:
        return [[True] * shape[1] for _ in range(shape[0])]
    return [[bool(v) for v in row] for row in mask.tolist()]


# -- gated attention (the core of Algorithms 7, 8, 13, 14) ------------------------------------------
def gated_attention(p: dict, x: torch.Tensor, bias, key_real: list, n_heads: int) -> torch.Tensor:
    """One row of L positions ``x`` ``(L, c_in)`` (already layer-normed) attending over itself.

    ``bias(h, i, j)`` is the logit bias of query i and key j in head h (or None); ``key_real[j]``
    False masks key j (its logit becomes -1e9). Returns ``(L, c_in)``."""
    L = x.shape[0]
    hc = p["q"]["w"].shape[1]
    assert hc % n_heads == 0, (hc, n_heads)
    c = hc // n_heads
    q, k, v = x @ p["q"]["w"], x @ p["k"]["w"], x @ p["v"]["w"]    # (L, H c), head-major
    g = torch.sigmoid(x @ p["gate"]["w"] + p["gate"]["b"])          # (L, H c)
    rows = []
    for i in range(L):
        heads = []
        for h in range(n_heads):
            ch = slice(h * c, (h + 1) * c)
            logits = []
            for j in range(L):
                if not key_real[j]:
                    logits.append(x.new_tensor(MASKED_LOGIT))
                    continue
                logit = (q[i, ch] * k[j, ch]).sum() / math.sqrt(c)
                logits.append(logit if bias is None else logit + bias(h, i, j))
            logits = torch.stack(logits)
            e = torch.exp(logits - logits.max())
            a = e / e.sum()
            o = a[0] * v[0, ch]
            for j in range(1, L):
                o = o + a[j] * v[j, ch]
            heads.append(o)
        rows.append(g[i] * torch.cat(heads))
    return linear(p["out"], torch.stack(rows))


# -- Algorithms 7, 8: MSA attention ------------------------------------------------------------------
def msa_row_attention(p: dict, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor | None) -> torch.Tensor:
    """Algorithm 7: each sequence s attends over its residues, bias_hij = (LN(z_ij) @ w_bias)_h."""
    S, R, _ = m.shape
    n_heads = p["bias"]["w"].shape[1]
    mask = _bools(msa_mask, (S, R))
    mn = layer_norm(p["ln_m"], m)
    b = layer_norm(p["ln_z"], z) @ p["bias"]["w"]   # (R, R, H)
    return torch.stack([gated_attention(p, mn[s], lambda h, i, j: b[i, j, h], mask[s], n_heads)
                        for s in range(S)])


def msa_column_attention(p: dict, m: torch.Tensor, msa_mask: torch.Tensor | None, n_heads: int) -> torch.Tensor:
    """Algorithm 8: at each residue i, the sequences attend over each other; key t masked by
    msa_mask[t, i]."""
    S, R, _ = m.shape
    mask = _bools(msa_mask, (S, R))
    mn = layer_norm(p["ln"], m)
    cols = [gated_attention(p, mn[:, i], None, [mask[t][i] for t in range(S)], n_heads) for i in range(R)]
    return torch.stack(cols, dim=1)


# -- Algorithms 9, 15: transitions -------------------------------------------------------------------
def transition(p: dict, x: torch.Tensor) -> torch.Tensor:
    """``fc2(relu(fc1(LN(x))))``, unmasked."""
    return linear(p["fc2"], torch.relu(linear(p["fc1"], layer_norm(p["ln"], x))))


# -- Algorithm 10: outer product mean ----------------------------------------------------------------
def outer_product_mean(p: dict, m: torch.Tensor, msa_mask: torch.Tensor | None) -> torch.Tensor:
    """``o_ij = sum_s a_si (x) b_sj / (1e-3 + sum_s mask_si mask_sj)`` flattened ``c1 * c + c2``,
    then ``out``; a and b are zero at masked positions."""
    S, R, _ = m.shape
    mask = _bools(msa_mask, (S, R))
    x = layer_norm(p["ln"], m)
    a, b = linear(p["a"], x), linear(p["b"], x)      # (S, R, c)
    c = a.shape[-1]
    rows = []
    for i in range(R):
        row = []
        for j in range(R):
            o = a.new_zeros(c * c)
            norm = OPM_EPS
            for s in range(S):
                w_si, w_sj = float(mask[s][i]), float(mask[s][j])
                outer = torch.stack([torch.stack([a[s, i, c1] * w_si * b[s, j, c2] * w_sj for c2 in range(c)])
                                     for c1 in range(c)])   # (c1, c2)
                o = o + outer.reshape(c * c)                  # index c1 * c + c2
                norm += w_si * w_sj
            row.append(linear(p["out"], o / norm))
        rows.append(torch.stack(row))
    return torch.stack(rows)


# -- Algorithms 11, 12: triangle multiplication ------------------------------------------------------
def triangle_multiplication(p: dict, z: torch.Tensor, pair_mask: torch.Tensor | None, *,
                            outgoing: bool) -> torch.Tensor:
    """Outgoing ``x_ij = sum_k a_ik * b_jk``, incoming ``x_ij = sum_k a_ki * b_kj``; the update
    ``sigmoid(gate(zn_ij)) * out(LN_out(x_ij))``."""
    R = z.shape[0]
    mask = _bools(pair_mask, (R, R))
    zn = layer_norm(p["ln_in"], z)
    a = torch.sigmoid(linear(p["a_gate"], zn)) * linear(p["a_proj"], zn)   # (R, R, c)
    b = torch.sigmoid(linear(p["b_gate"], zn)) * linear(p["b_proj"], zn)
    am = lambda u, w: a[u, w] * float(mask[u][w])  # noqa: E731
    bm = lambda u, w: b[u, w] * float(mask[u][w])  # noqa: E731
    rows = []
    for i in range(R):
        row = []
        for j in range(R):
            x = a.new_zeros(a.shape[-1])
            for k in range(R):
                x = x + (am(i, k) * bm(j, k) if outgoing else am(k, i) * bm(k, j))
            row.append(torch.sigmoid(linear(p["gate"], zn[i, j])) * linear(p["out"], layer_norm(p["ln_out"], x)))
        rows.append(torch.stack(row))
    return torch.stack(rows)


# -- Algorithms 13, 14: triangle attention -----------------------------------------------------------
def triangle_attention(p: dict, z: torch.Tensor, pair_mask: torch.Tensor | None, *, starting: bool) -> torch.Tensor:
    """Starting node: in row i, query (i, j) attends over keys (i, k), bias_hjk from zn_jk, key mask
    pair_mask[i, k]. Ending node: in column j, query (i, j) attends over keys (k, j), bias_hik from
    zn_ki, key mask pair_mask[k, j]."""
    R = z.shape[0]
    n_heads = p["bias"]["w"].shape[1]
    mask = _bools(pair_mask, (R, R))
    zn = layer_norm(p["ln"], z)
    b = zn @ p["bias"]["w"]   # (R, R, H): b[u, w, h] from zn_uw
    out = [[None] * R for _ in range(R)]
    for r in range(R):
        if starting:   # row i = r; positions j (query) / k (key) index z[r, .]
            upd = gated_attention(p, zn[r], lambda h, j, k: b[j, k, h], mask[r], n_heads)
            for j in range(R):
                out[r][j] = upd[j]
        else:          # column j = r; positions i (query) / k (key) index z[., r]
            upd = gated_attention(p, zn[:, r], lambda h, i, k: b[k, i, h], [mask[k][r] for k in range(R)], n_heads)
            for i in range(R):
                out[i][r] = upd[i]
    return torch.stack([torch.stack(row) for row in out])


# -- Algorithm 6: the block, and the stack -----------------------------------------------------------
def evoformer_block(p: dict, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor | None,
                    pair_mask: torch.Tensor | None, *, n_heads_msa: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One block on one example (no dropout)."""
    m = m + msa_row_attention(p["row_att"], m, z, msa_mask)
    m = m + msa_column_attention(p["col_att"], m, msa_mask, n_heads_msa)
    m = m + transition(p["msa_transition"], m)
    z = z + outer_product_mean(p["outer_product_mean"], m, msa_mask)
    z = z + triangle_multiplication(p["tri_mul_out"], z, pair_mask, outgoing=True)
    z = z + triangle_multiplication(p["tri_mul_in"], z, pair_mask, outgoing=False)
    z = z + triangle_attention(p["tri_att_start"], z, pair_mask, starting=True)
    z = z + triangle_attention(p["tri_att_end"], z, pair_mask, starting=False)
    z = z + transition(p["pair_transition"], z)
    return m, z


def evoformer(params: dict, m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor | None = None,
              pair_mask: torch.Tensor | None = None, *, n_heads_msa: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stack ``params["blocks"]`` in order; leading batch dims of ``m`` / ``z`` (and of a mask
    that has them) are looped over one example at a time."""
    if m.dim() > 3:
        outs = []
        for n in range(m.shape[0]):
            mm = msa_mask[n] if msa_mask is not None and msa_mask.dim() > 2 else msa_mask
            pm = pair_mask[n] if pair_mask is not None and pair_mask.dim() > 2 else pair_mask
            outs.append(evoformer(params, m[n], z[n], mm, pm, n_heads_msa=n_heads_msa))
        return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
    for p in params["blocks"]:
        m, z = evoformer_block(p, m, z, msa_mask, pair_mask, n_heads_msa=n_heads_msa)
    return m, z

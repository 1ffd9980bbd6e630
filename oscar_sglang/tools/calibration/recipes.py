"""Turn captured covariances into rotations (the `oscar` recipe).

For one layer (and one KV head, or all heads pooled when shared):

* K: Sigma_K = mean over tokens and over the query heads that read this KV head of q q^T.
  Quantisation error on k_rot is seen by attention only through q . err, so K's basis follows
  the queries' energy (OSCAR's "qqt").
* V: Sigma_V = mean of o o^T with o = softmax(q K^T) V the attention output, i.e. V^T S^T S V
  (S the attention matrix): V's covariance weighted by how strongly the attention reads each
  token (OSCAR's "sst").
* R = U H P: U the eigenvectors sorted by decreasing eigenvalue (sign fixed so that the largest
  component of each is positive, for reproducibility), H the orthonormal Sylvester Hadamard, and,
  when the quant group is smaller than head_dim, P the bit-reversal permutation of the columns
  (OSCAR's "r_h_pbr"). With one group per row P changes nothing (min-max and the clip do not
  depend on column order), so it is left out.
"""
from __future__ import annotations

import torch
from oscar_kernels.hadamard import bit_reverse_indices, hadamard


def sorted_eigenvectors(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cov [D, D] float64 -> (U [D, D] columns by decreasing eigenvalue, eigenvalues [D])."""
    cov = 0.5 * (cov + cov.T)
    evals, evecs = torch.linalg.eigh(cov)
    order = torch.argsort(evals, descending=True, stable=True)
    evals, evecs = evals[order], evecs[:, order]
    idx = evecs.abs().argmax(dim=0)
    signs = torch.sign(evecs[idx, torch.arange(evecs.shape[1])])
    signs[signs == 0] = 1
    return evecs * signs, evals


def oscar_rotation(cov: torch.Tensor, group_size: int) -> torch.Tensor:
    """R = U H (P_br when group_size < D), float64 [D, D], row-vector convention x @ R."""
    D = cov.shape[-1]
    u, _ = sorted_eigenvectors(cov.double().cpu())
    r = u @ hadamard(D)
    if group_size < D:
        r = r[:, bit_reverse_indices(D)]
    return r


def rotations_from_stats(stats, num_layers: int, group_size: int, per_head: bool):
    """stats: layer -> LayerStats. Returns (k_rot [L, H, D, D], v_rot [L, H, Dv, Dv]) float32,
    H = num_kv_heads if per_head else 1."""
    ks, vs = [], []
    for layer in range(num_layers):
        st = stats[layer]
        qq, oo = st.qq.cpu() / st.n, st.oo.cpu() / st.n
        if not per_head:  # one matrix shared by the KV heads: pool their covariances
            qq, oo = qq.mean(0, keepdim=True), oo.mean(0, keepdim=True)
        ks.append(torch.stack([oscar_rotation(c, group_size) for c in qq]))
        vs.append(torch.stack([oscar_rotation(c, group_size) for c in oo]))
    return torch.stack(ks).float(), torch.stack(vs).float()

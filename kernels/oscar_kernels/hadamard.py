"""Orthonormal Hadamard matrices and the bit-reversal permutation (torch only)."""
from __future__ import annotations

import torch


def hadamard(n: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """Sylvester Hadamard H_n / sqrt(n): symmetric, orthonormal, H @ H = I. n must be a power of 2."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / (n**0.5)


def bit_reverse_indices(n: int) -> torch.Tensor:
    """perm[i] = bit-reversal of i over log2(n) bits."""
    bits = n.bit_length() - 1
    if 1 << bits != n:
        raise ValueError(f"size must be a power of two, got {n}")
    return torch.tensor([int(f"{i:0{bits}b}"[::-1], 2) if bits else 0 for i in range(n)])

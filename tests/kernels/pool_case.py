"""The paged INT2 pool the kernel tests share (decode, fast decode, extend): INT2 codes/params at
random slots, BF16 sink/ring rows, with the cases that cross every source boundary. Side-buffer
entries the source rule must never read hold huge garbage."""
import torch

from oscar_kernels import Int2Format
from oscar_kernels import reference as ref


DEV = "cuda" if torch.cuda.is_available() else "cpu"
REL_TOL = 1e-4 if DEV == "cpu" else 2e-2  # the interpreter computes in fp32
S, W = 4, 8  # tiny sink / ring so short requests cross every boundary
GARBAGE = 1e4


def rotated_kv(n, h, d):
    """Rows with heavy-tailed channels (per head) and low-norm sink tokens at positions 0-1."""
    x = torch.randn(n, h, d)
    for j in range(h):
        ch = torch.randperm(d)[:3]
        x[:, j, ch] *= 1 + 15 * torch.rand(3)
    x[:2] *= 1e-2
    return x

def request_rows(n_rows, owns, sinks):
    """Request rows and their own_start / sink_start: request 0 is a CUDA-graph padding request
    at row 0, the others sit at shuffled rows, and unused rows hold garbage starts, so a kernel
    that indexed per-request state by batch position instead of by row would read wrong ones."""
    others = (torch.randperm(n_rows - 1)[: len(owns) - 1] + 1).tolist()
    rows = torch.tensor([0] + others, dtype=torch.int32)
    own_start = torch.randint(0, 60, (n_rows,), dtype=torch.int32)
    own_start[rows.long()] = torch.tensor(owns, dtype=torch.int32)
    sink_start = torch.randint(0, 60, (n_rows,), dtype=torch.int32)
    sink_start[rows.long()] = torch.tensor(sinks, dtype=torch.int32)
    return rows, own_start, sink_start


class Pool:
    """Paged INT2 pool + BF16 side buffers holding a batch of requests (slot 0 = padding)."""

    def __init__(self, lens, owns, hkv, d, g, n_rows=6, sinks=None):
        self.fmt = Int2Format(d, g)
        sinks = owns if sinks is None else sinks  # sink_start per request (default: own_start)
        self.lens, self.owns, self.sinks = lens, owns, sinks
        total = sum(lens)
        N = total + 7
        self.k_codes = torch.randint(0, 256, (N, hkv, d // 4), dtype=torch.uint8)
        self.v_codes = torch.randint(0, 256, (N, hkv, d // 4), dtype=torch.uint8)
        self.k_params = torch.rand(N, hkv, d // g, 2).half()
        self.v_params = torch.rand(N, hkv, d // g, 2).half()
        self.sink_k = torch.randn(n_rows, S, hkv, d).bfloat16() * GARBAGE
        self.sink_v = torch.randn(n_rows, S, hkv, d).bfloat16() * GARBAGE
        self.ring_k = torch.randn(n_rows, W, hkv, d).bfloat16() * GARBAGE
        self.ring_v = torch.randn(n_rows, W, hkv, d).bfloat16() * GARBAGE
        slots = (torch.randperm(N - 1)[:total] + 1).int()
        self.kv_indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        self.kv_indices = slots
        self.rows, self.own_start, self.sink_start = request_rows(n_rows, owns, sinks)
        self.k, self.v = [], []
        for b, (L, own, sink0) in enumerate(zip(lens, owns, sinks)):
            k, v = rotated_kv(L, hkv, d), rotated_kv(L, hkv, d)
            self.k.append(k)
            self.v.append(v)
            sl = slots[self.kv_indptr[b]:self.kv_indptr[b + 1]].long()
            for x, codes, params, sink, ring in (
                (k, self.k_codes, self.k_params, self.sink_k, self.ring_k),
                (v, self.v_codes, self.v_params, self.sink_v, self.ring_v),
            ):
                c, p = ref.quantize(x, self.fmt)
                codes[sl], params[sl] = c, p
                r = int(self.rows[b])
                for pos in range(sink0, min(S, L)):
                    sink[r, pos] = x[pos].bfloat16()
                for pos in range(max(own, L - W), L):
                    ring[r, pos % W] = x[pos].bfloat16()

    def tensors(self):
        return [t.to(DEV) for t in (self.k_codes, self.k_params, self.v_codes, self.v_params,
                                    self.sink_k, self.sink_v, self.ring_k, self.ring_v)]

    def meta(self):
        return [t.to(DEV) for t in (self.kv_indptr, self.kv_indices, self.rows, self.own_start)]

    def kw(self):
        return {"sink_start": self.sink_start.to(DEV)}

    def request_kv(self, b):
        sl = self.kv_indices[self.kv_indptr[b]:self.kv_indptr[b + 1]]
        r = int(self.rows[b])
        own, sink0 = self.owns[b], self.sinks[b]
        K = ref.pool_request_kv(self.k_codes, self.k_params, self.sink_k, self.ring_k, sl, r, own, self.fmt, sink0)
        V = ref.pool_request_kv(self.v_codes, self.v_params, self.sink_v, self.ring_v, sl, r, own, self.fmt, sink0)
        return K, V


def rel_err(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


# lens/own_start/sink_start: padding request (len 1, row 0), short (< S+W: all BF16), own_start
# inside the sink (INT2 hole around the sink), own_start past the sink and the ring start (radix
# hit), and a radix hit whose sink and part of its ring copies were carried over (sink_start 0,
# own_start past the ring start: INT2 between the sink and the ring)
LENS = [1, 7, 45, 70, 60]
OWNS = [0, 0, 2, 66, 55]
SINKS = [0, 0, 2, 66, 0]

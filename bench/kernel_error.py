"""Each per-channel INT2 kernel's error against float64, on keys and values with outlier channels.

The kernel tests assert tolerances; this records the numbers in a results JSON. For each KV format
a batch of requests is written into a paged pool by the store kernel (ops.store_kv_channel, one
prefill call per request, as the server stores them); every kernel that reads that pool is then
compared with float64 attention (reference.attention) over the reader's view of the same keys
(reference.format_request_kv: BF16 sink and ring, the quantised body):

  decode          ops.decode_attention_channel, the default split plan and the fewest splits
                  (one long loop per request), and for 3-bit keys the packed body too
  extend          ops.extend_prefix_attention_channel: `dequant` and `codes`, with the prefix split,
                  and the short-extend launch of a batch that ends in one-token extends
  prefix_pieces   ops.dequant_prefix_channel (the BF16 rows FlashInfer reads for long prefill
                  chunks): error in bf16 ulps of the exact dequantised value (0.5 = correctly rounded)

Rows: kernel, variant, format, requests (prefix lengths; new tokens for extend), rel_err_max /
rel_err_mean over requests (||o - o_ref|| / ||o_ref||; each request's in rel_err_by_request, in the
order of `requests`), lse_err_max (extend: |lse - lse_ref|, natural log; within the tests' bound
when under test_tolerance x lse_ref_abs_max, as they check), max_ulps / rel_err (prefix_pieces), and
test_tolerance (what the kernel tests allow on this device; a kernel row over it makes the exit
status 1). A bf16_baseline row per format and
reader kind gives the same errors for attention in a BF16 flash kernel's arithmetic (bf16 operands
and probabilities, fp32 sums) over the same view: the error any BF16 kernel has on these inputs (no
tolerance applied). An arith_emulation row per format models the decode body's shared roundings
alone (arith_emulation), and each decode row records its distance to that model
(rel_diff_vs_arith_emulation): small against the row's error, the model explains it. Inputs: N(0, 1)
rows whose KV heads each have 4 channels scaled by 1-16 (the rotated caches' outliers) and low-norm
first tokens; queries N(0, 1) with one in four heads scaled by 4 (peaked attention). Fresh seed per
run unless --seed.

    python -m bench.kernel_error                               # GPU: the formats below, ~75 s a format (H200)
    python -m bench.kernel_error --formats k3c64-v2t64-s4-w128 --out /tmp/e.json
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time

import torch

from bench import _results
from oscar_sglang.runtime.kv_format import DEFAULT_KV_FORMAT  # noqa: E402 (the served default)
from oscar_kernels import ops  # noqa: E402
from oscar_kernels import reference as ref  # noqa: E402
from oscar_kernels.format import KVFormat, code_bytes  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the served default first (v2h: one value group per 128-dim head), the default before 2026-11-29 next
FORMATS = ",".join([DEFAULT_KV_FORMAT, "k3c64-v2t64-s4-w128", "k2c64-v2t64-s4-w128", "k3c64-v2t64-s64-w256"])
# prefix lengths: long, medium, a few blocks, one block + a bit (all body keys in the ring), one
DECODE_LENS = "32768,8192,2000,130,1"
# extend: prefix:new tokens; the one-token extends at the end take the short-extend launch
EXTEND_CASE = "16384:128,4096:64,1000:16,64:8,3000:1,700:1,5:1"
PIECE_ROWS = 4096
BASELINE = "bf16 operands and probabilities, fp32 sums"
EMULATION = "decode body's shared bf16 q * s and p * s, rest exact"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def outlier_rows(n, h, d, gen):
    """[n, h, d] bf16 rows: N(0, 1), 4 channels per head scaled by 1-16, first two tokens x 0.01."""
    x = torch.randn(n, h, d, generator=gen)
    for j in range(h):
        ch = torch.randperm(d, generator=gen)[:4]
        x[:, j, ch] *= 1 + 15 * torch.rand(4, generator=gen)
    x[:2] *= 1e-2
    return x.bfloat16()


def queries(t, hq, d, gen):
    q = torch.randn(t, hq, d, generator=gen)
    q[:, ::4] *= 4  # some heads attend sharply
    return q.bfloat16()


class StoredBatch:
    """Requests stored into one layer's pool by ops.store_kv_channel, each on its own shuffled
    pages (page 0 unused, as SGLang's allocator), each at its own request row (row 0 unused)."""

    def __init__(self, fmt, lens, hkv, gen):
        self.fmt, self.lens = fmt, lens
        D, B = fmt.head_dim, fmt.k_group
        pages = [max(1, math.ceil(L / B)) for L in lens]
        n_pages = sum(pages) + 1
        N = n_pages * B
        u8 = lambda n: torch.zeros(hkv, N, n, dtype=torch.uint8, device=DEV).transpose(0, 1)  # noqa: E731
        self.k_codes, self.v_codes = u8(code_bytes(fmt.k_bits, D)), u8(D // 4)
        self.k_params = torch.zeros(hkv, n_pages, D, 2, dtype=torch.float16, device=DEV).transpose(0, 1)
        self.v_params = torch.zeros(hkv, N, D // fmt.v_group, 2, dtype=torch.float16, device=DEV).transpose(0, 1)
        R = len(lens) + 1
        side = lambda s: torch.zeros(R, s, hkv, D, dtype=torch.bfloat16, device=DEV)  # noqa: E731
        self.sink_k, self.sink_v = side(max(fmt.sink, 1)), side(max(fmt.sink, 1))
        self.ring_k, self.ring_v = side(fmt.window), side(fmt.window)
        perm = (torch.randperm(n_pages - 1, generator=gen) + 1).tolist()
        self.k, self.v, slots = [], [], []
        self.rows = torch.arange(1, R, dtype=torch.int32, device=DEV)
        for b, L in enumerate(lens):
            pg = torch.tensor([perm.pop() for _ in range(pages[b])], dtype=torch.long)
            sl = (pg.repeat_interleave(B) * B + torch.arange(B).repeat(pages[b]))[:L].to(DEV)
            slots.append(sl)
            k, v = outlier_rows(L, hkv, D, gen), outlier_rows(L, hkv, D, gen)
            self.k.append(k)
            self.v.append(v)
            ops.store_kv_channel(
                k.to(DEV), v.to(DEV), sl, torch.arange(L, device=DEV),  # int64 positions, as SGLang
                self.rows[b].repeat(L), torch.full((L,), L, dtype=torch.int32, device=DEV),
                self.k_codes, self.k_params, self.v_codes, self.v_params,
                self.sink_k, self.sink_v, self.ring_k, self.ring_v,
                k_bits=fmt.k_bits, k_block=B, v_group=fmt.v_group)
        self.kv_indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        self.kv_indices = torch.cat(slots).int()
        self.slots = slots
        self.own = torch.zeros(R, dtype=torch.int32, device=DEV)

    def args(self):
        return (self.k_codes, self.k_params, self.v_codes, self.v_params, self.sink_k, self.sink_v,
                self.ring_k, self.ring_v, self.kv_indptr, self.kv_indices, self.rows, self.own)

    def kw(self):
        return dict(k_bits=self.fmt.k_bits, k_block=self.fmt.k_group, v_group=self.fmt.v_group)

    def view(self, b):
        """The reader's view of request b's keys and values (float32, on DEV)."""
        return tuple(ref.format_request_kv(x[b].float(), self.fmt, which).to(DEV)
                     for x, which in ((self.k, "k"), (self.v, "v")))


def rel_errors(out, want):
    return [((o.double() - w).norm() / w.norm()).item() for o, w in zip(out, want)]


def arith_emulation(st, b, q, sm_scale, rnd=None):
    """Request b's decode output [Hq, Dv] (float64) with the one rounding the per-channel decode
    body shares across keys modelled and everything else exact: each body block's q * s rounded
    to bf16 once for its 64 keys (codes exact, q . m exact), and each body token's p * value
    scale rounded to bf16 for its group (as the default byte reads do); sink and ring exact.
    CHANGELOG.md (2026-11-27 10:29) suspects that shared rounding of most of the decode's
    error on outlier inputs; this row, next to the kernel's, checks it on the GPU. The rounding
    points are the default 3-bit body's ("planes": q * s / place value, the softmax scale applied
    after); the other bodies fold the softmax scale into q first (same statistics, other bits).
    rnd: the rounding (default bf16; the identity gives exact attention over the reader's view)."""
    fmt, L = st.fmt, st.lens[b]
    K, V = (x.double() for x in st.view(b))
    _, _, body = ref.format_source_masks(L, fmt, 0, None, K.device)
    bf = rnd or (lambda x: x.bfloat16().double())
    H, g = K.shape[1], q.shape[0] // K.shape[1]
    qh = q.double().view(H, g, -1)  # [H, g, D]
    pages = st.slots[b][::fmt.k_group] // fmt.k_group
    kp = st.k_params[pages].double()  # [blocks, H, D, 2]: (scale, min)
    ks, km = kp[..., 0].repeat_interleave(fmt.k_group, 0)[:L], kp[..., 1].repeat_interleave(fmt.k_group, 0)[:L]
    code = torch.where(ks > 0, torch.round((K - km) / ks.clamp_min(1e-30)), 0.0)
    qs = bf(qh[None] * ks[:, :, None, :])  # [L, H, g, D]; identical within a block
    logits = torch.where(body[:, None, None], (qs * code[:, :, None, :]).sum(-1) + (qh[None] * km[:, :, None, :]).sum(-1),
                         torch.einsum("hgd,lhd->lhg", qh, K)) * sm_scale
    p = torch.exp(logits - logits.amax(0, keepdim=True))  # [L, H, g]
    vp = st.v_params[st.slots[b].long()].double()  # [L, H, Dv / group, 2]
    vs = vp[..., 0].repeat_interleave(fmt.v_group, -1)
    vm = vp[..., 1].repeat_interleave(fmt.v_group, -1)
    vcode = torch.where(vs > 0, torch.round((V - vm) / vs.clamp_min(1e-30)), 0.0)
    ps = bf(p[..., None] * vs[:, :, None, :])  # [L, H, g, Dv]
    contrib = torch.where(body[:, None, None, None], ps * vcode[:, :, None, :] + p[..., None] * vm[:, :, None, :],
                          p[..., None] * V[:, :, None, :])
    return (contrib.sum(0) / p.sum(0)[..., None]).reshape(H * g, -1)


def test_tolerance() -> float:
    """What the kernel tests allow on this device (tests/kernels/pool_case.REL_TOL): fp32 P @ V
    in the interpreter, bf16 on the GPU."""
    return 1e-4 if DEV == "cpu" else 2e-2


def bf16_attention(q, k, v, sm_scale):
    """Attention in a BF16 flash kernel's arithmetic, the baseline for the kernels' own error: q,
    k, v and the probabilities rounded to bf16, scores, softmax and sums in fp32 (bf16 x bf16
    products are exact in fp32). Same shapes and returns as reference.attention."""
    bf = lambda x: x.bfloat16().float()  # noqa: E731
    g = q.shape[1] // k.shape[1]
    kk, vv = bf(k).repeat_interleave(g, dim=1), bf(v).repeat_interleave(g, dim=1)
    s = torch.einsum("thd,lhd->htl", bf(q), kk) * sm_scale
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    lse = (m.squeeze(-1) + torch.log(p.sum(-1)))
    o = torch.einsum("htl,lhd->thd", bf(p), vv) / p.sum(-1).transpose(0, 1).unsqueeze(-1)
    return o, lse.transpose(0, 1)


def row(kernel, variant, fmt, requests, errs, tol, lse_ref_abs_max=None, **extra):
    """tol None: a baseline row (no tolerance applies). The LSE bound is the tests' own: tol times
    the largest |lse| of the reference (test_channel_kernels), here also in natural log units."""
    r = dict(kernel=kernel, variant=variant, format=fmt.name, requests=requests,
             rel_err_max=max(errs), rel_err_mean=sum(errs) / len(errs), test_tolerance=tol,
             rel_err_by_request=errs, **extra)
    if lse_ref_abs_max is not None:
        r["lse_ref_abs_max"] = lse_ref_abs_max
    if tol is not None:
        lse_ok = extra.get("lse_err_max", 0.0) <= tol * max(1.0, lse_ref_abs_max or 0.0)
        r["within_test_tolerance"] = r["rel_err_max"] <= tol and lse_ok
    log(f"  {kernel:13s} {variant:22s} {fmt.name:24s} rel err max {r['rel_err_max']:.2e} "
        f"mean {r['rel_err_mean']:.2e}" + (f" lse {extra['lse_err_max']:.1e}" if "lse_err_max" in extra else ""))
    return r


def decode_rows(fmt, lens, hkv, gqa, gen, tol):
    st = StoredBatch(fmt, lens, hkv, gen)
    D, Hq = fmt.head_dim, hkv * gqa
    q = queries(len(lens), Hq, D, gen).to(DEV)
    sm = D ** -0.5
    want, base = [], []
    for b in range(len(lens)):
        K, V = st.view(b)
        want.append(ref.attention(q[b:b + 1], K, V, sm_scale=sm)[0][0])
        base.append(bf16_attention(q[b:b + 1].float(), K, V, sm)[0][0])
    rows = [row("bf16_baseline", BASELINE, fmt, list(lens), rel_errors(base, want), None)]
    emu = [arith_emulation(st, b, q[b], sm) for b in range(len(lens))]
    rows.append(row("arith_emulation", EMULATION, fmt, list(lens), rel_errors(emu, want), None))
    variants = {"default splits": {}, "fewest splits": {"num_kv_splits": torch.ones(len(lens), dtype=torch.int32, device=DEV)}}
    for name, kw in variants.items():
        # fp32 output, as the kernel tests: the server's bf16 output adds one rounding (~2e-3)
        o = torch.full((len(lens), Hq, D), float("nan"), device=DEV)
        ops.decode_attention_channel(q, o, *st.args(), **st.kw(), sm_scale=sm, **kw)
        rows.append(row("decode", name, fmt, list(lens), rel_errors(o, want), tol,
                        rel_diff_vs_arith_emulation=max(rel_errors(o, emu))))
    # flat attention (every head's q ~ N(0, 0.3^2)): the output is a near-cancelling mean of the
    # zero-mean values, the case where the value operands' offsets cost the most
    # (tests/gpu/test_long_decode.py's); one split per request, so each walks every body block
    qf = (torch.randn(len(lens), Hq, D, generator=gen) * 0.3).bfloat16().to(DEV)
    want_f, base_f = [], []
    for b in range(len(lens)):
        K, V = st.view(b)
        want_f.append(ref.attention(qf[b:b + 1], K, V, sm_scale=sm)[0][0])
        base_f.append(bf16_attention(qf[b:b + 1].float(), K, V, sm)[0][0])
    rows.append(row("bf16_baseline", BASELINE + "; flat q", fmt, list(lens), rel_errors(base_f, want_f), None))
    o = torch.full((len(lens), Hq, D), float("nan"), device=DEV)
    ops.decode_attention_channel(qf, o, *st.args(), **st.kw(), sm_scale=sm, **variants["fewest splits"])
    rows.append(row("decode", "flat q, fewest splits", fmt, list(lens), rel_errors(o, want_f), tol))
    return rows


def extend_rows(fmt, case, hkv, gqa, gen, tol):
    prefix = [p for p, _ in case]
    new = [e for _, e in case]
    st = StoredBatch(fmt, prefix, hkv, gen)
    D, Hq = fmt.head_dim, hkv * gqa
    qo = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = queries(int(qo[-1]), Hq, D, gen).to(DEV)
    sm = D ** -0.5
    want, base = [], []
    for b in range(len(case)):
        K, V = st.view(b)
        want.append(ref.attention(q[qo[b]:qo[b + 1]], K, V, sm_scale=sm))
        base.append(bf16_attention(q[qo[b]:qo[b + 1]].float(), K, V, sm))
    lse_ref = max(w[1].abs().max().item() for w in want)
    requests = [f"{p}+{e}" for p, e in case]
    lse_err = lambda lse: max((lse[qo[b]:qo[b + 1]].double() - want[b][1]).abs().max().item()  # noqa: E731
                              for b in range(len(case)))
    rows = [row("bf16_baseline", BASELINE, fmt, requests, rel_errors([x[0] for x in base], [w[0] for w in want]),
                None, lse_ref_abs_max=lse_ref,
                lse_err_max=max((x[1].double() - w[1]).abs().max().item() for x, w in zip(base, want)))]
    variants = {
        "one launch": dict(),
        "prefix split": dict(max_len_prefix=max(prefix), num_splits=4),
        "short tail": dict(extend_lens=new),
    }
    for name, kw in variants.items():
        o, lse = ops.extend_prefix_attention_channel(q, qo, *st.args(), **st.kw(), sm_scale=sm,
                                                    max_len_extend=max(new), **kw)
        errs = rel_errors([o[qo[b]:qo[b + 1]] for b in range(len(case))], [w[0] for w in want])
        rows.append(row("extend", name, fmt, requests, errs, tol, lse_ref_abs_max=lse_ref, lse_err_max=lse_err(lse)))
    return rows, st


def ulps(got, want):
    """|got - want| in bf16 ulps of want (0.5: correctly rounded)."""
    w = want.double()
    e = torch.floor(torch.log2(w.abs().clamp_min(2.0 ** -126)))
    return (got.double() - w).abs() / torch.exp2(e - 7)


def piece_rows(st, hkv):
    """The whole prefix of every request of `st` as BF16 rows, PIECE_ROWS positions a piece."""
    fmt, lens = st.fmt, st.lens
    D = fmt.head_dim
    worst_ulps, num, den = 0.0, 0.0, 0.0
    for lo in range(0, max(lens), PIECE_ROWS):
        n = [max(0, min(PIECE_ROWS, L - lo)) for L in lens]
        indptr = torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        rows = int(indptr[-1])
        out_k = torch.empty(rows, hkv, D, dtype=torch.bfloat16, device=DEV)
        out_v = torch.empty(rows, hkv, D, dtype=torch.bfloat16, device=DEV)
        ops.dequant_prefix_channel(*st.args(), torch.full((len(lens),), lo, dtype=torch.int32, device=DEV),
                                   indptr, out_k, out_v, **st.kw(), max_piece_len=max(n))
        for b in range(len(lens)):
            if n[b] == 0:
                continue
            s, e = int(indptr[b]), int(indptr[b + 1])
            for got, want in zip((out_k[s:e], out_v[s:e]), st.view(b)):
                w = want[lo:lo + n[b]]
                worst_ulps = max(worst_ulps, ulps(got, w).max().item())
                num += (got.double() - w.double()).pow(2).sum().item()
                den += w.double().pow(2).sum().item()
    r = dict(kernel="prefix_pieces", variant=f"pieces of {PIECE_ROWS}", format=fmt.name, requests=list(lens),
             max_ulps=worst_ulps, rel_err=math.sqrt(num / den))
    log(f"  prefix_pieces {r['variant']:22s} {fmt.name:24s} max {worst_ulps:.2f} bf16 ulps, rel err {r['rel_err']:.2e}")
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=FORMATS, help="comma list of per-channel KV format names")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--gqa", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--decode-lens", default=DECODE_LENS, help="comma list of decode context lengths")
    ap.add_argument("--extend-case", default=EXTEND_CASE, help="comma list of prefix:new-tokens per request")
    ap.add_argument("--seed", type=int, help="default: a fresh one (recorded)")
    ap.add_argument("--out", help="JSON path (default bench/results/kernels/<UTC date_time>_kernel-error.json)")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    tol = test_tolerance()
    decode_lens = [int(x) for x in args.decode_lens.split(",")]
    case = [tuple(int(v) for v in c.split(":")) for c in args.extend_case.split(",")]
    t0 = time.time()
    rows = []
    for name in filter(None, args.formats.split(",")):
        fmt = KVFormat.parse(name, head_dim=args.head_dim)
        if fmt.k_layout != "channel":
            raise SystemExit(f"{name}: not a per-channel key format (this benchmark reads the channel kernels)")
        log(f"{name} (device {DEV}, seed {seed}):")
        rows += decode_rows(fmt, decode_lens, args.kv_heads, args.gqa, gen, tol)
        ext, st = extend_rows(fmt, case, args.kv_heads, args.gqa, gen, tol)
        rows += ext
        rows.append(piece_rows(st, args.kv_heads))
    # what a row without its own switch ran (the kernels' defaults, or the environment's)
    doc = _results.document(
        "synthetic (per-channel pool written by ops.store_kv_channel)", rows, seed=seed,
        head_dim=args.head_dim, kv_heads=args.kv_heads, gqa=args.gqa,
        seconds=round(time.time() - t0, 1))
    out = args.out or str(_results.default_path("kernels")).replace(".json", "_kernel-error.json")
    log(f"wrote {_results.write(out, doc)}")
    over = [r for r in rows if r.get("within_test_tolerance") is False]
    name = lambda r: f"{r['kernel']} {r['variant']} {r['format']}"  # noqa: E731
    if over:
        log("over the kernel tests' tolerance: " + "; ".join(map(name, over)))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())

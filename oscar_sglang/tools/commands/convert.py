"""`oscar-sglang convert`: rotation files to / from the OSCAR research fork's .pt layout."""
from __future__ import annotations

DESCRIPTION = """\
Direction follows the input:
  oscar-sglang convert ROT.safetensors --out-dir DIR
      -> DIR/k_rotation_qqt_r_h_pbr.pt, DIR/v_rotation_sst_r_h_pbr.pt (the fork's file names)
  oscar-sglang convert K.pt [--v-file V.pt] --out ROT.safetensors [--model-id ID] [--k-clip R] [--v-clip R]
The fork's files hold no clip ratios (it reads them from env vars): give --k-clip/--v-clip
(e.g. its defaults 0.96 / 0.92), otherwise 1.0 (no clip) unless the .pt was written by us.
"""

K_PT_NAME = "k_rotation_qqt_r_h_pbr.pt"
V_PT_NAME = "v_rotation_sst_r_h_pbr.pt"


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser("convert", help="convert rotation files to / from the OSCAR fork's .pt layout",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="our .safetensors file, or the fork's K .pt file")
    p.add_argument("--v-file", default=None, help="the fork's V .pt file (input .pt only)")
    p.add_argument("--out-dir", default=None, help="output directory (input .safetensors)")
    p.add_argument("--out", default=None, help="output .safetensors (input .pt)")
    p.add_argument("--model-id", default=None, help="model id to record (input .pt)")
    p.add_argument("--k-clip", type=float, default=None, help="K clip ratio to record (input .pt)")
    p.add_argument("--v-clip", type=float, default=None, help="V clip ratio to record (input .pt)")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys
    from pathlib import Path

    from ...common.rotations import (RotationFileError, load_oscar_pt, load_rotation_file,
                             save_oscar_pt, save_rotation_file)

    src = Path(args.input)
    try:
        if src.suffix == ".pt":
            if not args.out:
                print("convert: give --out FILE.safetensors for a .pt input", file=sys.stderr)
                return 2
            rs = load_oscar_pt(src, args.v_file, k_clip=args.k_clip, v_clip=args.v_clip)
            if args.model_id:
                rs.metadata["model_id"] = args.model_id
            sha = save_rotation_file(rs, args.out)
            print(f"wrote {args.out} (sha256 {sha}), {rs.num_layers} layers, recipe {rs.recipe}")
        else:
            if not args.out_dir:
                print("convert: give --out-dir DIR for a .safetensors input", file=sys.stderr)
                return 2
            rs = load_rotation_file(src)
            k, v = Path(args.out_dir) / K_PT_NAME, Path(args.out_dir) / V_PT_NAME
            save_oscar_pt(rs, k, v)
            print(f"wrote {k} and {v} ({rs.num_layers} layers)")
    except RotationFileError as e:
        print(f"convert: {e}", file=sys.stderr)
        return 1
    return 0

"""`oscar-sglang zoo`: list / show / verify / pull ready-made rotation files."""
from __future__ import annotations

DESCRIPTION = """\
The zoo is a directory with index.json (model, recipe, file, sha256, metrics) and the files:
by default $OSCAR_SGLANG_ZOO_DIR, else the source tree's rotation_zoo/, else
~/.cache/oscar-sglang/zoo (where `pull` puts downloads).

  oscar-sglang zoo list
  oscar-sglang zoo show smollm2
  oscar-sglang zoo verify                  # sha256 + validity of every file; exit 1 on any failure
  oscar-sglang zoo add rotation_zoo/FILE --command "oscar-sglang calibrate ..."
  oscar-sglang zoo pull HuggingFaceTB/SmolLM2-135M-Instruct [--repo ID] [--endpoint URL]
"""


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser("zoo", help="list / show / verify / pull rotation files",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zoo", default=None, metavar="DIR", help="zoo directory (see above)")
    zs = p.add_subparsers(dest="zoo_command", metavar="ACTION")
    zs.add_parser("list", help="entries of the index and whether their files are present")
    s = zs.add_parser("show", help="an entry and its file's metadata")
    s.add_argument("model", help="model id (or alias 'smollm2'), or file name")
    s.add_argument("--recipe", default=None)
    v = zs.add_parser("verify", help="check sha256 and validity of the zoo's files")
    v.add_argument("model", nargs="?", default=None)
    a = zs.add_parser("add", help="add (or refresh) a rotation file's entry in the zoo index")
    a.add_argument("file", help="rotation file inside the zoo directory")
    a.add_argument("--command", default=None, help="the command that produced it (recorded)")
    pl = zs.add_parser("pull", help="download a model's rotation file from a Hugging Face repo")
    pl.add_argument("model")
    pl.add_argument("--recipe", default="oscar")
    pl.add_argument("--repo", default=None, help="Hugging Face repo id (default $OSCAR_SGLANG_ZOO_REPO or oscar-sglang/rotation-zoo)")
    pl.add_argument("--revision", default=None)
    pl.add_argument("--endpoint", default=None, help="Hub endpoint or mirror URL (default: huggingface.co / $HF_ENDPOINT)")
    p.set_defaults(func=run)


def _model(name):
    from ..models import EMBEDDED_ALIASES, EMBEDDED_MODEL_ID

    return EMBEDDED_MODEL_ID if name in EMBEDDED_ALIASES else name


def run(args) -> int:
    import json
    import sys
    from pathlib import Path

    from .. import zoo

    zoo_dir = Path(args.zoo) if args.zoo else zoo.default_zoo_dir()
    try:
        if args.zoo_command == "pull":
            dest = Path(args.zoo) if args.zoo else None
            for p in zoo.pull(_model(args.model), args.recipe, args.repo, args.revision,
                              args.endpoint, dest):
                print(f"pulled and verified {p}")
            return 0
        if args.zoo_command == "add":
            f = Path(args.file)
            if f.resolve().parent != zoo_dir.resolve():
                print(f"zoo: {f} must be inside the zoo directory {zoo_dir}", file=sys.stderr)
                return 1
            extra = {"command": args.command} if args.command else {}
            e = zoo.add_to_index(f, zoo_dir, **extra)
            print(f"indexed {e['file']} ({e['model']}, {e['recipe']}, sha256 {e['sha256'][:16]}...)")
            return 0
        index = zoo.read_index(zoo_dir)
        if args.zoo_command == "list" or args.zoo_command is None:
            print(f"zoo: {zoo_dir}")
            print(f"{'model':40s} {'recipe':9s} {'G':>4s} {'err(K+V)':>9s}  {'file':45s} present")
            for e in index["entries"]:
                # data-free entries carry no metrics: use those measured (on the same held-out
                # tokens) by a calibrated entry of the same model
                err = next((o["metrics"]["kv"][e.get("recipe")] for o in [e] + index["entries"]
                            if o.get("model") == e.get("model")
                            and e.get("recipe") in o.get("metrics", {}).get("kv", {})), None)
                present = "yes" if (zoo_dir / e["file"]).is_file() else "no"
                print(f"{str(e.get('model')):40s} {e.get('recipe', '?'):9s} {str(e.get('group_size')):>4s} "
                      f"{'' if err is None else f'{err:9.4f}':>9s}  {e['file']:45s} {present}")
            return 0
        if args.zoo_command == "show":
            entries = zoo.find_entries(index, _model(args.model), args.recipe)
            if not entries:
                print(f"zoo: no entry for {args.model!r}; see `oscar-sglang zoo list`", file=sys.stderr)
                return 1
            from ...common.rotations import load_rotation_file

            for e in entries:
                print(json.dumps(e, indent=2, sort_keys=True))
                f = zoo_dir / e["file"]
                if f.is_file():
                    rs = load_rotation_file(f)
                    md = {k: v for k, v in rs.metadata.items() if k != "clip_search"}
                    print("file metadata:", json.dumps(md, indent=2, sort_keys=True))
                    print("k_clip:", [round(x, 2) for x in rs.k_clip.tolist()])
                    print("v_clip:", [round(x, 2) for x in rs.v_clip.tolist()])
            return 0
        if args.zoo_command == "verify":
            entries = zoo.find_entries(index, _model(args.model)) if args.model else index["entries"]
            bad = 0
            for e in entries:
                ok, msg = zoo.verify_entry(e, zoo_dir)
                bad += not ok
                print(msg)
            print(f"{len(entries) - bad}/{len(entries)} files verified")
            return 1 if bad or not entries else 0
    except zoo.ZooError as e:
        print(f"zoo: {e}", file=sys.stderr)
        return 1
    return 2

"""`oscar-sglang eval`: accuracy of the INT2 KV cache.

  eval fidelity  KLD / top-1 / perplexity vs the unquantised model, KV cache emulated in
                 transformers (teacher forcing, exact sink/recent windows), recipes side by side
  eval niah      needle-in-a-haystack against any OpenAI-compatible server (--url), or
                 locally in transformers, BF16 vs the emulated INT2 cache (--local MODEL)
"""
from __future__ import annotations

import logging

log = logging.getLogger("oscar_sglang.eval")

DEFAULT_RECIPES = "bf16,identity,kivi,hadamard,hadamard-ts,int4,oscar"


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _wrap(text: str, width: int = 92) -> str:
    """Fill each paragraph (the raw formatter keeps line breaks, so long lines stay long)."""
    import textwrap

    return "\n\n".join(textwrap.fill(p, width) for p in text.split("\n\n"))


def add_parser(subparsers) -> None:
    import argparse

    raw = argparse.RawDescriptionHelpFormatter  # keep the line breaks of descriptions/examples
    p = subparsers.add_parser("eval", help="accuracy: fidelity vs BF16, needle-in-a-haystack",
                              description=__doc__, formatter_class=raw)
    sub = p.add_subparsers(dest="eval_command", metavar="WHAT")
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])

    f = sub.add_parser(
        "fidelity", help="KLD / top-1 / PPL of KV-cache recipes vs the unquantised model",
        description="Teacher-forced fidelity of emulated KV-cache recipes vs the unquantised "
        "model on held-out text. Query t reads key j in BF16 iff j < sink or j > t - recent, "
        "else its INT2 copy; only positions t >= sink + recent are scored.",
        epilog="Example: oscar-sglang eval fidelity --model smollm2 --rotation "
        "cal=rotation_zoo/SmolLM2-135M-Instruct.oscar.g64.safetensors --group-sizes 32,64 --out docs/results",
    )
    f.add_argument("--model", default="smollm2", help="HF id, directory, .gguf, or 'smollm2'")
    f.add_argument("--rotation", action="append", metavar="[LABEL=]FILE",
                   help="rotation file for the 'oscar' recipe (repeat to compare several)")
    f.add_argument("--recipe", default=DEFAULT_RECIPES,
                   help=f"comma-separated recipes (default {DEFAULT_RECIPES}; 'oscar' is "
                   "dropped when no --rotation is given); NAME+clip=K/V fixes clip ratios")
    f.add_argument("--group-sizes", type=_ints, default=[32, 64, 128],
                   help="comma-separated quantisation group sizes (default 32,64,128)")
    f.add_argument("--length", type=int, default=2048, help="tokens per window (default 2048)")
    f.add_argument("--windows", type=int, default=2, help="number of windows (default 2)")
    f.add_argument("--first-window", type=int, default=0,
                   help="skip this many windows of the text first (default 0)")
    f.add_argument("--sink", type=int, default=64, help="BF16 sink tokens (default 64)")
    f.add_argument("--recent", type=int, default=256, help="BF16 recent window (default 256)")
    f.add_argument("--data", nargs="*", default=None,
                   help=".txt/.jsonl files (default: the held-out essays, never used to calibrate)")
    f.add_argument("--device", default="cpu")
    f.add_argument("--query-chunk", type=int, default=512,
                   help="queries per attention block (bounds memory at long windows)")
    f.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    f.add_argument("--out", default="eval_results", help="output directory")
    f.add_argument("--name", default=None, help="file stem (default fidelity-<length>)")
    f.add_argument("--merge", nargs="*", default=[], metavar="JSON",
                   help="add the rows of earlier fidelity JSON files (same windows) to the report")
    f.add_argument("--ref-cache", default=None, metavar="DIR",
                   help="keep the reference log-probs here and reuse them in later runs")
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    f.set_defaults(func=run_fidelity_command)

    n = sub.add_parser(
        "niah", help="needle-in-a-haystack over the essays (OpenAI server or local)",
        formatter_class=raw,
        description=_wrap("Needle-in-a-haystack: a random 7-digit 'magic number' is hidden at a "
        "given depth of a Paul Graham essay haystack and the model is asked for it (greedy). "
        "Scored by exact match: the first integer of the answer must equal the number (the "
        "looser 'contains' score is reported next to it).\n\n"
        "Against a server (--url; any OpenAI-compatible one, e.g. ours with --kv-cache-dtype "
        "int2, or BF16), the defaults need no tuning: 10 depths (0.05, 0.15 .. 0.95, the "
        "centres of the ten deciles), lengths 1K/2K/4K plus the longest that fits the context "
        "the server reports, and enough trials per cell for >= 100 prompts per server. Every "
        "trial has its own needle and haystack, fixed by --seed, so two servers get the same "
        "prompts. --local MODEL: transformers, BF16 vs the emulated INT2 cache (old small "
        "defaults: 3 lengths x 5 depths x 1 trial). Writes <name>.json, .md and .png."),
        epilog="Examples:\n  oscar-sglang eval niah --url http://127.0.0.1:30000\n"
        "  oscar-sglang eval niah --base-url int2=http://127.0.0.1:30000/v1 "
        "bf16=http://127.0.0.1:30001/v1 --kv-tokens-from-server\n"
        "  oscar-sglang eval niah --local smollm2 --rotation "
        "rotation_zoo/SmolLM2-135M-Instruct.oscar.g64.safetensors --lengths 1024,2048",
    )
    src = n.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", action="append", metavar="[LABEL=]URL",
                     help="an OpenAI-compatible server: http://HOST:PORT or .../v1 (repeat "
                     "for several)")
    src.add_argument("--base-url", nargs="+", metavar="[LABEL=]URL",
                     help="several servers at once, side by side in the report")
    src.add_argument("--local", metavar="MODEL", help="run in transformers (e.g. smollm2)")
    n.add_argument("--label", default=None, help="name of a single unlabelled server (default: its url)")
    n.add_argument("--model-name", default=None,
                   help="'model' field of requests (default: first of GET /v1/models)")
    n.add_argument("--tokenizer", default="auto",
                   help="tokenizer to size contexts: 'auto' (the server's tokenizer when it is "
                   "on this machine, else the served model id from the local Hugging Face "
                   "cache, else 'chars'), 'smollm2', an HF id/dir, or 'chars' (4 characters "
                   "per token)")
    n.add_argument("--context-length", type=int, default=None,
                   help="the model's context in tokens (default: what the server reports in "
                   "/v1/models max_model_len or /server_info context_length)")
    n.add_argument("--lengths", type=_ints, default=None,
                   help="context lengths in tokens (default for servers: 1024,2048,4096 and the "
                   "longest multiple of 256 that fits the context with the answer; "
                   "1024,2048,4096 with --local or when the context is unknown)")
    n.add_argument("--depths", type=_floats, default=None,
                   help="needle depths in [0, 1] (default for servers: 0.05,0.15,...,0.95; "
                   "--local: 0,0.25,0.5,0.75,1)")
    n.add_argument("--trials", type=int, default=None,
                   help="needles per cell (default for servers: enough for --min-trials per "
                   "server; --local: 1)")
    n.add_argument("--min-trials", type=int, default=100,
                   help="prompts per server when --trials is not given (default 100)")
    n.add_argument("--max-requests", type=int, default=20000,
                   help="refuse grids larger than this many requests in all (default 20000)")
    n.add_argument("--concurrency", type=int, default=16, help="parallel requests (default 16)")
    n.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default 120)")
    n.add_argument("--retries", type=int, default=3,
                   help="retries per request, with backoff 1, 2, 4.. s (default 3)")
    n.add_argument("--max-errors", type=int, default=20,
                   help="stop sending to a server after this many failed requests (default 20)")
    n.add_argument("--max-tokens", type=int, default=32,
                   help="answer tokens (default 32: SmolLM2 spends ~10 on 'The special magic number ... is' and one per digit)")
    n.add_argument("--seed", type=int, default=0, help="needle numbers / haystack seed (default 0)")
    n.add_argument("--kv-tokens-from-server", action="store_true",
                   help="read /server_info and store the KV tokens that fit "
                   "(max_total_num_tokens) and the plugin's oscar_int2 report per server")
    n.add_argument("--rotation", default=None,
                   help="--local: rotation file of the 'oscar' recipe")
    n.add_argument("--recipe", default=None,
                   help="--local: comma-separated recipes, one INT2 grid each (names as in "
                   "eval fidelity; default: oscar with --rotation, else hadamard)")
    n.add_argument("--group-size", type=int, default=64, help="--local: INT2 group (default 64)")
    n.add_argument("--sink", type=int, default=64)
    n.add_argument("--recent", type=int, default=256)
    n.add_argument("--out", default="eval_results", help="output directory")
    n.add_argument("--name", default="niah", help="file stem (default niah)")
    n.add_argument("--quiet", action="store_true", help="no progress bar")
    n.set_defaults(func=run_niah_command)


def _progress(quiet: bool):
    if quiet:
        return None
    from tqdm.auto import tqdm

    return tqdm


def run_fidelity_command(args) -> int:
    import torch

    from ..data import heldout_essays, read_texts
    import json
    from pathlib import Path

    from ..evaluation.fidelity import as_dict, make_windows, merge_runs, run_fidelity
    from ..evaluation.recipes import parse_recipe, parse_rotation_args
    from ..evaluation.report import fidelity_markdown, fidelity_plot, write_outputs
    from ..models import load_causal_lm, model_identity

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    rotations = parse_rotation_args(args.rotation)
    specs = [s.strip() for s in args.recipe.split(",") if s.strip()]
    if not rotations and args.recipe == DEFAULT_RECIPES:
        specs.remove("oscar")
        log.info("no --rotation given: skipping the 'oscar' recipe")
    try:
        recipes = [r for s in specs for r in parse_recipe(s, rotations)]
    except ValueError as e:
        log.error("error: %s", e)
        return 2
    log.info("loading %s ...", args.model)
    model, tok = load_causal_lm(args.model, device=args.device)
    texts = read_texts(args.data) if args.data else read_texts(heldout_essays())
    windows = make_windows(tok, texts, args.first_window + args.windows, args.length)
    windows = windows[args.first_window :].to(args.device)
    log.info("%d window(s) x %d tokens; recipes: %s; groups %s", args.windows, args.length,
             ", ".join(r.name for r in recipes), args.group_sizes)
    run = run_fidelity(model, windows, recipes, args.group_sizes, sink=args.sink,
                       recent=args.recent, query_chunk=args.query_chunk,
                       progress=_progress(args.quiet), model_name=model_identity(args.model),
                       ref_cache=args.ref_cache)
    d = as_dict(run)
    d["meta"] = {"command": "oscar-sglang eval fidelity", "device": args.device,
                 "threads": torch.get_num_threads(), "data": args.data or "heldout essays",
                 "first_window": args.first_window}
    if args.merge:
        try:
            merge_runs(d, [json.loads(Path(p).read_text()) for p in args.merge])
        except ValueError as e:
            log.error("error: %s", e)
            return 2
    md = fidelity_markdown(d)
    paths = write_outputs(args.out, args.name or f"fidelity-{args.length}", d, md, fidelity_plot)
    print(md)
    log.info("wrote %s", ", ".join(map(str, paths)))
    return 0


def run_niah_command(args) -> int:
    import shlex
    import sys

    from ..evaluation.niah import main_niah

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not getattr(args, "command_line", None):  # what was typed, for the JSON
        args.command_line = "oscar-sglang " + shlex.join(getattr(args, "argv", None) or sys.argv[1:])
    return main_niah(args, progress=_progress(args.quiet))

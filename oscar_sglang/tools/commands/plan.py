"""`oscar-sglang plan`: what a GPU's KV budget holds, per KV format, before starting a server."""
from __future__ import annotations

DESCRIPTION = """\
How many KV tokens, and how many running requests' BF16 side buffers, a KV budget holds with each
KV format, next to SGLang's BF16 and FP8 (fp8_e4m3) caches on the same budget. It is the plugin's
own sizing (what `--kv-cache-dtype int2` logs at start: "OSCAR INT2 KV pool: ..."), computed from
the model's config.json alone: no GPU, no download. OSCAR_* variables that change sizing
(OSCAR_KV_FORMAT for the 'default' row, OSCAR_SINK_TOKENS, OSCAR_RECENT_TOKENS, OSCAR_GROUP_SIZE,
OSCAR_MAX_RUNNING_REQUESTS, OSCAR_SIDE_BUFFER_FRACTION) apply as they would in a server.

The budget is what SGLang gives the KV cache on one GPU (one attention-TP rank): a BF16 server's
start-up log says it ("KV Cache is allocated. #tokens: N, K size: X GB, V size: Y GB": X + Y), and
so does the int2 server's "budget ... GiB". Roughly: --mem-fraction-static x GPU memory, less the
weights' share on that GPU and a few GiB of activations and CUDA graphs.

  oscar-sglang plan --model-path /models/Llama-3.1-8B-Instruct --kv-budget-gib 51.6
  oscar-sglang plan --model-path config.json --kv-budget-gib 51.6 --tp-size 2 \\
      --formats default,k3c64-v2t64-s4-w128,token --json plan.json
"""

DEFAULT_FORMATS = "default,k3c64-v2t64-s4-w128,k2c64-v2t64-s4-w128,token"
GIB = 1 << 30


def add_parser(sub) -> None:
    import argparse

    p = sub.add_parser("plan", help="KV tokens and running requests per KV format for a model and KV budget",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True,
                   help="a model directory with config.json, or the config.json file")
    p.add_argument("--kv-budget-gib", type=float, required=True,
                   help="KV cache memory of one GPU in GiB (see above)")
    p.add_argument("--formats", default=DEFAULT_FORMATS,
                   help=f"comma-separated OSCAR_KV_FORMAT values; 'default' is what a server started "
                        f"here stores (OSCAR_KV_FORMAT if set, else the plugin's default) "
                        f"(default: {DEFAULT_FORMATS})")
    p.add_argument("--tp-size", type=int, default=1, help="tensor parallelism (KV heads split across GPUs)")
    p.add_argument("--max-running-requests", type=int, default=None,
                   help="as the server option; default: the plugin's default sizing")
    p.add_argument("--speculative-draft-layers", type=int, default=0,
                   help="speculative decoding with a draft model (EAGLE / STANDALONE): its layers, KV "
                        "shaped like the target's as SGLang assumes; its cache is BF16 beside an INT2 "
                        "pool and in the pool's dtype beside BF16 / FP8 (default 0: no draft model)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=0,
                   help="speculative decoding: drafts a verify step (the INT2 pool keeps their rollback "
                        "buffers per request; default 0: no speculation)")
    p.add_argument("--hicache-ratio", type=float, default=0.0,
                   help="HiCache's host tier as SGLang sizes it, a multiple of the device pool's tokens "
                        "(adds a host-tokens column; int2 refuses HiCache at start until it has run on "
                        "a GPU)")
    p.add_argument("--hicache-size", type=float, default=0.0,
                   help="HiCache's host tier in GB (1e9 bytes), as SGLang's flag; overrides the ratio")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    p.set_defaults(func=run)


class PlanInputError(ValueError):
    """A config.json or an argument the planner cannot use; the message says what to give."""


def model_geometry(model_path: str) -> dict:
    """(layers, KV heads, head_dim, v_head_dim, name) from a Hugging Face config.json; a
    vision-language config's text_config is the language model's."""
    import json
    from pathlib import Path

    path = Path(model_path)
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.is_file():
        raise PlanInputError(f"--model-path {model_path}: no config.json there (give a local model "
                             "directory or its config.json; plan downloads nothing)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise PlanInputError(f"{cfg_file}: not a readable JSON file ({e})") from None
    text = cfg.get("text_config") or cfg
    try:
        layers = int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError) as e:
        raise PlanInputError(f"{cfg_file}: no {e} for the attention geometry (num_hidden_layers, "
                             "num_attention_heads, num_key_value_heads, head_dim or hidden_size)") from None
    if "kv_lora_rank" in text:
        raise PlanInputError(f"{cfg_file}: an MLA model (kv_lora_rank), which --kv-cache-dtype int2 "
                             "refuses at start (docs/serving.md)")
    return {"model": cfg.get("_name_or_path") or cfg_file.resolve().parent.name, "num_layers": layers,
            "num_kv_heads": kv_heads, "head_dim": head_dim,
            "v_head_dim": int(text.get("v_head_dim") or head_dim)}


def plan_rows(budget_bytes: int, geom: dict, formats: list[str], *, tp_size: int = 1,
              max_running_requests: int | None = None, cfg=None, draft_layers: int = 0,
              draft_tokens: int = 0, hicache_ratio: float = 0.0, hicache_size_gb: float = 0.0) -> list[dict]:
    """One row per KV cache: SGLang's BF16 and FP8 pools (no side buffers) and each format as the
    plugin sizes it (runtime/sizing.plan_pool); a format the server would refuse gets its reason.
    cfg: the plugin's OscarConfig (runtime/config.load_config; None = no OSCAR_* variable set):
    its sink / recent sizes, per-token group and default request sizing apply, as in a server.
    draft_layers / draft_tokens: speculative decoding's share, as the servers size it (SGLang
    scales a BF16 / FP8 token by (layers + draft layers) / layers; the INT2 pool adds the draft's
    BF16 cache a token and the rollback buffers a request). hicache_ratio / hicache_size_gb: each
    row's host tier as SGLang's HostKVCache sizes it (size / bytes a token, or ratio x device
    tokens), INT2 pages without the device's 4-byte slot pointer (runtime/host_pool.py)."""
    from ...runtime import sizing
    from ...runtime.config import OscarConfig
    from ...runtime.draft_rollback import DraftRollback
    from ...runtime.kv_format import KVFormatError, resolve

    cfg = cfg or OscarConfig()

    _, local_heads = sizing.kv_head_range(geom["num_kv_heads"], tp_size, 0)
    shape = sizing.ModelKVShape(num_layers=geom["num_layers"], num_kv_heads=local_heads,
                                head_dim=geom["head_dim"], v_head_dim=geom["v_head_dim"])
    elems = shape.num_layers * shape.num_kv_heads * (shape.head_dim + shape.v_head_dim)
    draft_elems = draft_layers * shape.num_kv_heads * (shape.head_dim + shape.v_head_dim)
    rows = [{"kv_cache": kv, "format": None, "bits_per_element": 8.0 * b, "bytes_per_token": elems * b,
             "kv_tokens": budget_bytes // ((elems + draft_elems) * b), "max_running_requests": None,
             "side_buffer_gib": 0.0}
            for kv, b in (("bf16", 2), ("fp8_e4m3", 1))]
    speculative = {}
    if draft_layers:
        speculative["draft_bytes_per_token"] = draft_elems * 2
    if draft_tokens:
        speculative["rollback_bytes_per_request"] = DraftRollback.bytes_per_row(
            shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.v_head_dim, draft_tokens)
    for asked in formats:
        name = asked
        if asked == "default":  # what a server started here stores; "" = the plugin's default
            name = cfg.kv_format if "kv_format" in cfg.sources else ""
        row = {"kv_cache": "int2", "format_requested": asked}
        try:
            fmt = resolve(name, head_dim=shape.head_dim, v_head_dim=shape.v_head_dim,
                          num_layers=shape.num_layers, group_size=cfg.group_size,
                          sink=cfg.sink_tokens if "sink_tokens" in cfg.sources else None,
                          recent=cfg.recent_tokens if "recent_tokens" in cfg.sources else None)
            plan = sizing.plan_pool(budget_bytes, shape, fmt=fmt, page_size=fmt.page_size or 1,
                                    requested_max_running_requests=max_running_requests,
                                    default_max_running_requests=cfg.default_max_running_requests,
                                    side_buffer_fraction=cfg.side_buffer_fraction, **speculative)
        except (KVFormatError, sizing.PoolSizingError) as e:
            rows.append({**row, "format": None, "refused": str(e)})
            continue
        rows.append({**row, "format": fmt.name, "bits_per_element": fmt.body_bits_per_element(),
                     "bytes_per_token": plan.bytes_per_token, "kv_tokens": plan.max_total_num_tokens,
                     "max_running_requests": plan.max_running_requests,
                     "side_buffer_gib": plan.side_bytes_total / GIB, "notes": plan.notes})
    bf16, fp8 = rows[0]["kv_tokens"], rows[1]["kv_tokens"]
    for r in rows:
        if "kv_tokens" in r:
            r["x_bf16"], r["x_fp8"] = r["kv_tokens"] / bf16, r["kv_tokens"] / fp8
            if hicache_ratio or hicache_size_gb:
                per = r["bytes_per_token"] - (sizing.INT32_BYTES if r["kv_cache"] == "int2" else 0)
                r["host_bytes_per_token"] = per
                r["host_tokens"] = (int(hicache_size_gb * 1e9 // per) if hicache_size_gb
                                    else int(r["kv_tokens"] * hicache_ratio))
                r["host_gib"] = r["host_tokens"] * per / GIB
    return rows


def table(rows: list[dict]) -> str:
    host = any("host_tokens" in r for r in rows)
    lines = ["| KV cache | stored format | bits / element | bytes / token | KV tokens | x BF16 | x FP8 "
             "| running requests (side buffers) |" + (" host tokens (GiB) |" if host else ""),
             "|---|---|---:|---:|---:|---:|---:|---|" + ("---:|" if host else "")]
    for r in rows:
        name = r["kv_cache"] if r["kv_cache"] != "int2" else f"int2 `{r['format_requested']}`"
        if "refused" in r:
            lines.append(f"| {name} | refused: {r['refused']} | | | | | | |" + (" |" if host else ""))
            continue
        side = ("any (none)" if r["max_running_requests"] is None
                else f"{r['max_running_requests']:,} ({r['side_buffer_gib']:.2f} GiB)")
        extra = f" {r['host_tokens']:,} ({r['host_gib']:.1f}) |" if host else ""
        lines.append(f"| {name} | {r['format'] or '-'} | {r['bits_per_element']:.3f} | {r['bytes_per_token']:,} "
                     f"| {r['kv_tokens']:,} | {r['x_bf16']:.2f}x | {r['x_fp8']:.2f}x | {side} |" + extra)
    return "\n".join(lines)


def run(args) -> int:
    import json
    import sys

    from ...runtime.config import OscarConfigError, load_config

    try:
        try:
            cfg = load_config()  # OSCAR_* variables size as they would in a server
        except OscarConfigError as e:
            raise PlanInputError(str(e)) from None
        if args.kv_budget_gib <= 0 or args.tp_size < 1:
            raise PlanInputError("--kv-budget-gib must be > 0 and --tp-size >= 1")
        if args.speculative_draft_layers < 0 or args.speculative_num_draft_tokens < 0:
            raise PlanInputError("--speculative-draft-layers and --speculative-num-draft-tokens must be >= 0")
        if args.hicache_ratio < 0 or args.hicache_size < 0:
            raise PlanInputError("--hicache-ratio and --hicache-size must be >= 0")
        geom = model_geometry(args.model_path)
        if args.tp_size > 1 and geom["num_kv_heads"] % args.tp_size and args.tp_size % geom["num_kv_heads"]:
            raise PlanInputError(f"--tp-size {args.tp_size} does not divide the model's "
                                 f"{geom['num_kv_heads']} KV heads (nor they it): SGLang cannot split them")
        formats = [f.strip() for f in args.formats.split(",") if f.strip()]
        budget = int(args.kv_budget_gib * GIB)
        rows = plan_rows(budget, geom, formats, tp_size=args.tp_size,
                         max_running_requests=args.max_running_requests, cfg=cfg,
                         draft_layers=args.speculative_draft_layers,
                         draft_tokens=args.speculative_num_draft_tokens,
                         hicache_ratio=args.hicache_ratio, hicache_size_gb=args.hicache_size)
    except PlanInputError as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    print(f"{geom['model']}: {geom['num_layers']} layers, {geom['num_kv_heads']} KV heads of "
          f"{geom['head_dim']} dims, TP {args.tp_size}; KV budget {args.kv_budget_gib:g} GiB per GPU")
    print(table(rows))
    if args.hicache_ratio or args.hicache_size:
        print("Host tokens: HiCache's host tier per GPU as SGLang sizes it "
              + (f"(--hicache-size {args.hicache_size:g} GB)" if args.hicache_size
                 else f"(--hicache-ratio {args.hicache_ratio:g} x the device tokens)")
              + "; with int2, HiCache is refused at start until its host tier has run on a GPU.")
    if args.max_running_requests is None:
        print(f"Running requests: the server's default, at most {cfg.default_max_running_requests:,} "
              f"and side buffers within {cfg.side_buffer_fraction:.0%} of the budget "
              "(OSCAR_MAX_RUNNING_REQUESTS, OSCAR_SIDE_BUFFER_FRACTION, or --max-running-requests N).")
    else:
        for r in rows:
            for note in r.get("notes", []):
                print(f"note ({r['format']}): {note}")
    if cfg.sources:
        print("OSCAR_* settings applied: " + ", ".join(sorted(set(cfg.sources.values()))))
    if args.json:
        doc = {"command": "oscar-sglang " + " ".join(args.argv), "model": geom, "tp_size": args.tp_size,
               "kv_budget_bytes": budget, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    return 0

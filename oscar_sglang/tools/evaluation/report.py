"""Markdown tables and PNG plots for the accuracy harness (matplotlib, Agg backend)."""
from __future__ import annotations

import json
from pathlib import Path


def _num(x: float) -> str:
    return f"{x:.4f}" if x >= 1e-3 else f"{x:.1e}"


def fidelity_markdown(run: dict) -> str:
    ref = run["reference"]
    lines = [
        f"Model `{run['model']}`, {run['windows']} window(s) of {run['length']} tokens, "
        f"sink {run['sink']}, recent {run['recent']}; scored positions per recipe: "
        f"{ref.get('positions', 0)}; reference PPL {ref.get('ppl', float('nan')):.2f}.",
        "",
        "| recipe | group | bits/elt | KLD | top-1 | PPL | K clip (mean) | V clip (mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in run["results"]:
        if "skipped" in r:
            continue
        g = r["group_size"] or "-"
        lines.append(
            f"| {r['recipe']} | {g} | {r['bits_per_element']:.2f} | {_num(r['kld'])} | "
            f"{r['top1']:.4f} | {r['ppl']:.2f} | {r['k_clip_mean']:.3f} | {r['v_clip_mean']:.3f} |"
        )
    skipped = [r for r in run["results"] if "skipped" in r]
    if skipped:
        lines.append("")
        lines.append("Not run: " + "; ".join(
            f"{r['recipe']} g{r['group_size']} ({r['skipped']})" for r in skipped))
    return "\n".join(lines) + "\n"


def fidelity_plot(run: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in run["results"] if "skipped" not in r and r["group_size"]]
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    groups = sorted({r["group_size"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / max(len(groups), 1)
    for gi, g in enumerate(groups):
        by = {r["recipe"]: r for r in rows if r["group_size"] == g}
        xs = [i + (gi - (len(groups) - 1) / 2) * width for i in range(len(recipes))]
        for ax, key in zip(axes, ("kld", "top1")):
            ax.bar(xs, [by[n][key] if n in by else 0 for n in recipes], width, label=f"group {g}")
    for ax, title in zip(axes, ("KL divergence vs unquantised (lower is better)",
                                "top-1 agreement (higher is better)")):
        ax.set_xticks(range(len(recipes)))
        ax.set_xticklabels(recipes, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_ylim(0, 1)
    axes[1].legend(fontsize=8, loc="lower left", framealpha=0.9)
    fig.suptitle(f"{run['model']}: {run['length']}-token windows, sink {run['sink']}, "
                 f"recent {run['recent']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def niah_markdown(run: dict) -> str:
    lines = []
    for name, grid in run["grids"].items():
        depths = run["depths"]
        extra = ""
        if "accuracy_contains" in grid:  # exact match is the score; 'contains' for comparison
            extra = f", contains {grid['accuracy_contains']:.2f}"
        where = f" ({grid['model']} at {grid['url']})" if grid.get("url") else ""
        lines.append(f"**{name}**{where}: accuracy {grid['accuracy']:.2f}{extra} over "
                     f"{grid['n']} prompts ({grid.get('errors', 0)} request errors)")
        lines.append("")
        lines.append("| context \\ depth | " + " | ".join(f"{d:.0%}" for d in depths) + " |")
        lines.append("|---" * (len(depths) + 1) + "|")
        for i, ctx in enumerate(run["lengths"]):
            cells = " | ".join(f"{v:.2f}" if v is not None else "-" for v in grid["cells"][i])
            lines.append(f"| {ctx} | {cells} |")
        lines.append("")
    return "\n".join(lines)


def niah_heatmaps(run: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(run["grids"])
    w = max(4.2, 0.55 * len(run["depths"]) + 1.6)  # 10 depths need room for their labels
    fig, axes = plt.subplots(1, len(names), figsize=(w * len(names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        cells = run["grids"][name]["cells"]
        a = np.array([[np.nan if v is None else v for v in row] for row in cells], dtype=float)
        im = ax.imshow(a, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(run["depths"])))
        ax.set_xticklabels([f"{d:.0%}" for d in run["depths"]], fontsize=8)
        ax.set_yticks(range(len(run["lengths"])))
        ax.set_yticklabels([str(x) for x in run["lengths"]], fontsize=8)
        ax.set_xlabel("needle depth")
        ax.set_ylabel("context tokens")
        score = "exact" if "accuracy_contains" in run["grids"][name] else "acc"
        ax.set_title(f"{name} ({score} {run['grids'][name]['accuracy']:.2f})", fontsize=9)
        for i in range(a.shape[0]):
            for j in range(a.shape[1]):
                if not np.isnan(a[i, j]):
                    ax.text(j, i, f"{a[i, j]:.1f}", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=axes[0].tolist(), fraction=0.03)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def write_outputs(out_dir, stem: str, run: dict, markdown: str, plot) -> list[Path]:
    """<stem>.json, <stem>.md and <stem>.png under out_dir; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"]
    paths[0].write_text(json.dumps(run, indent=1))
    paths[1].write_text(markdown)
    plot(run, paths[2])
    return paths

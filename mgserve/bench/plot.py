"""``mgserve bench plot``: tokens/s against context depth, drawn from ``bench model --json`` files.

One line per (file, sessions) of the decode rows (aggregate tokens/s of B sessions at a depth), and
a second panel with the prefill rows, so "as fast at 250k as at 5k" can be seen at a glance. Needs
matplotlib (``pip install matplotlib``); runs anywhere, not only where the bench ran.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", help="JSON files written by `bench model --json`")
    parser.add_argument("--labels", default="", help="comma-separated legend names, one per file")
    parser.add_argument("--out", default="bench-depth.png", help="the PNG to write")
    parser.add_argument("--title", default="", help="the figure's title")


def series(rows: list[dict]) -> dict[tuple[str, int], list[tuple[int, float]]]:
    """(kind, sessions) -> [(depth, tokens/s)] sorted by depth, for the rows that have a depth."""
    out: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        if r.get("kind") in ("decode", "prefill") and "depth" in r:
            out[(r["kind"], int(r["sessions"]))].append((int(r["depth"]), float(r["tokens_per_s"])))
    return {k: sorted(v) for k, v in sorted(out.items())}


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("mgserve bench plot needs matplotlib: pip install matplotlib") from None
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else []
    runs = []
    for i, f in enumerate(args.files):
        data = json.loads(Path(f).read_text())
        if "rows" not in data:
            raise SystemExit(f"{f}: not a `bench model --json` file (no 'rows')")
        runs.append((labels[i] if i < len(labels) else Path(f).stem, data))
    drawn = [(label, key, pts) for label, data in runs for key, pts in series(data["rows"]).items()]
    if not drawn:
        raise SystemExit("no decode or prefill rows with a depth in " + ", ".join(args.files))
    kinds = [k for k in ("decode", "prefill") if any(key[0] == k for _, key, _ in drawn)]
    width = max(6 * len(kinds), 10)  # one panel still holds a model-and-GPU title
    fig, axes = plt.subplots(1, len(kinds), figsize=(width, 4.5), squeeze=False)
    panels = dict(zip(kinds, axes[0], strict=True))  # a panel per kind that has rows
    for label, (kind, sessions), pts in drawn:
        who = "1 session" if sessions == 1 else f"{sessions} sessions, aggregate"
        panels[kind].plot(
            [d / 1000 for d, _ in pts], [t for _, t in pts], "o-", label=f"{label}: {who}"
        )
    for what, ax in panels.items():
        ax.set_xlabel("context depth (k tokens)")
        ax.set_ylabel("tokens/s")
        ax.set_title(what)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # room above the highest point
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    first = runs[0][1]
    title = args.title or f"{first.get('model', '')} on {first.get('gpu', '')}"
    fig.suptitle(title, fontsize=10 if len(title) > 90 else 12)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0

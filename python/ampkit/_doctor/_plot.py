"""The doctor's picture: per-module underflow and overflow fractions over sampled steps."""

from __future__ import annotations

from pathlib import Path


def heatmap(rows, path, title="ampkit.doctor"):
    """Write a PNG of two heatmaps (underflow, overflow): modules down, sampled steps across.

    ``rows``: ``doctor.stats()``. Returns the path written."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = Path(path)
    modules = list(dict.fromkeys(r["module"] for r in rows)) or ["(no samples)"]
    steps = sorted({r["step"] for r in rows}) or [0]
    grids = {k: [[0.0] * len(steps) for _ in modules] for k in ("underflow", "overflow")}
    for r in rows:
        i, j = modules.index(r["module"]), steps.index(r["step"])
        for k in grids:
            grids[k][i][j] = r[k]
    fig, axes = plt.subplots(1, 2, figsize=(4 + 0.25 * len(steps) * 2, 1.5 + 0.3 * len(modules)),
                             squeeze=False)
    for ax, (k, g) in zip(axes[0], grids.items()):
        im = ax.imshow(g, aspect="auto", cmap="magma", vmin=0, vmax=max(max(max(row) for row in g), 1e-6))
        ax.set_title(f"{k} fraction")
        ax.set_yticks(range(len(modules)), [m or "(model)" for m in modules], fontsize=7)
        ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7)
        ax.set_xlabel("step")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

"""PNG plots of metrics against step."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_metrics(rows: list[dict], keys: list[str], out: Path, title: str = "") -> Path | None:
    """One PNG with a panel per metric key present in ``rows`` (x = step)."""
    present = [k for k in keys if any(r.get(k) is not None for r in rows)]
    if not present:
        return None
    fig, axes = plt.subplots(1, len(present), figsize=(4 * len(present), 3.2), squeeze=False)
    for ax, key in zip(axes[0], present, strict=True):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

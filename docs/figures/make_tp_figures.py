"""Draw the tensor-parallel pictures of docs/tensor_parallel.md: python docs/figures/make_tp_figures.py"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = ["tab:blue", "tab:orange"]


def matrix(ax, x, y, w, h, label, split=None, shade=None):
    """A labelled matrix; ``split`` 'cols' or 'rows' colours two halves, one per rank."""
    if split is None:
        ax.add_patch(Rectangle((x, y), w, h, fc=shade or "0.88", ec="k"))
    else:
        for i, c in enumerate(RANKS):
            if split == "cols":
                ax.add_patch(Rectangle((x + i * w / 2, y), w / 2, h, fc=c, alpha=0.35, ec="k"))
            else:
                ax.add_patch(Rectangle((x, y + (1 - i) * h / 2), w, h / 2, fc=c, alpha=0.35, ec="k"))
    ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=9)


def mlp_figure(path):
    fig, ax = plt.subplots(figsize=(9.5, 3.2))
    matrix(ax, 0.0, 0.5, 1.0, 1.5, "X\n(all ranks)")
    ax.text(1.25, 1.25, "f", fontsize=13, ha="center", va="center", weight="bold")
    ax.text(1.75, 1.25, "x", fontsize=11, ha="center", va="center")
    matrix(ax, 2.0, 0.75, 1.6, 1.0, "A = [A1 | A2]\ncolumn-parallel", split="cols")
    ax.annotate("", xy=(4.3, 1.25), xytext=(3.7, 1.25), arrowprops=dict(arrowstyle="->"))
    matrix(ax, 4.4, 0.5, 2.0, 1.5, "Y = [Y1 | Y2]\nY_r = GeLU(X A_r)\nlocal, no sync", split="cols")
    ax.text(6.65, 1.25, "x", fontsize=11, ha="center", va="center")
    matrix(ax, 6.9, 0.5, 1.2, 1.5, "B = [B1; B2]\nrow-\nparallel", split="rows")
    ax.annotate("", xy=(8.8, 1.25), xytext=(8.2, 1.25), arrowprops=dict(arrowstyle="->"))
    ax.text(9.05, 1.25, "g", fontsize=13, ha="center", va="center", weight="bold")
    matrix(ax, 9.3, 0.5, 1.0, 1.5, "Z = Y1 B1\n+ Y2 B2")
    ax.text(5.15, 2.45, "f: identity forward, all-reduce backward     g: all-reduce forward, identity backward",
            ha="center", fontsize=9)
    ax.text(5.15, 0.1, "rank 0 holds the blue halves, rank 1 the orange ones: one all-reduce each way",
            ha="center", fontsize=9)
    ax.set_xlim(-0.1, 10.4)
    ax.set_ylim(0, 2.7)
    ax.axis("off")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


def sequence_parallel_figure(path):
    fig, ax = plt.subplots(figsize=(9.5, 2.8))
    stages = [("LayerNorm\n(B, T/N, C)", "seq"), ("all-gather\nT", None), ("column-parallel\n(B, T, 4C/N)", "hid"),
              ("GeLU, row-parallel\npartial sums", "hid"), ("reduce-scatter\nT", None),
              ("dropout + residual\n(B, T/N, C)", "seq")]
    x = 0.0
    for label, kind in stages:
        if kind is None:
            ax.annotate("", xy=(x + 1.1, 1.0), xytext=(x, 1.0), arrowprops=dict(arrowstyle="->", lw=1.5))
            ax.text(x + 0.55, 1.35, label, ha="center", fontsize=8)
            x += 1.25
            continue
        for i, c in enumerate(RANKS):  # each rank's share: a slice of T, or of the hidden size
            if kind == "seq":
                ax.add_patch(Rectangle((x, 0.3 + (1 - i) * 0.7), 1.4, 0.7, fc=c, alpha=0.35, ec="k"))
            else:
                ax.add_patch(Rectangle((x + i * 0.7, 0.3), 0.7, 1.4, fc=c, alpha=0.35, ec="k"))
        ax.text(x + 0.7, -0.05, label, ha="center", va="top", fontsize=8)
        x += 1.6
    ax.text(x / 2, 2.0, "sequence-parallel regions split T; tensor-parallel regions split the hidden size",
            ha="center", fontsize=9)
    ax.set_xlim(-0.1, x)
    ax.set_ylim(-0.7, 2.2)
    ax.axis("off")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    mlp_figure(os.path.join(HERE, "tp_mlp.png"))
    sequence_parallel_figure(os.path.join(HERE, "sequence_parallel.png"))

"""Draw the tensor-parallel pictures of docs/tensor_parallel.md: python docs/figures/make_tp_figures.py"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = ["tab:blue", "tab:orange"]


def matrix(ax, x, y, w, h, label, split=None, parts=None, shade=None):
    """A matrix with ``label`` under it; ``split`` 'cols' or 'rows' colours two halves, one per
    rank, each named inside by ``parts`` (the labels sit outside the boxes, so none overflows)."""
    if split is None:
        ax.add_patch(Rectangle((x, y), w, h, fc=shade or "0.88", ec="k"))
        if parts:
            ax.text(x + w / 2, y + h / 2, parts, ha="center", va="center", fontsize=9)
    else:
        for i, c in enumerate(RANKS):
            if split == "cols":
                ax.add_patch(Rectangle((x + i * w / 2, y), w / 2, h, fc=c, alpha=0.35, ec="k"))
                at = (x + (i + 0.5) * w / 2, y + h / 2)
            else:
                ax.add_patch(Rectangle((x, y + (1 - i) * h / 2), w, h / 2, fc=c, alpha=0.35, ec="k"))
                at = (x + w / 2, y + (1.5 - i) * h / 2)
            ax.text(*at, parts[i], ha="center", va="center", fontsize=10)
    ax.text(x + w / 2, y - 0.1, label, ha="center", va="top", fontsize=8.5)


def mlp_figure(path):
    fig, ax = plt.subplots(figsize=(9.5, 3.6))
    matrix(ax, 0.0, 0.9, 1.0, 1.5, "X\n(all ranks)", parts="X")
    ax.text(1.25, 1.65, "f", fontsize=13, ha="center", va="center", weight="bold")
    ax.text(1.75, 1.65, "x", fontsize=11, ha="center", va="center")
    matrix(ax, 2.0, 1.15, 1.6, 1.0, "A = [A1 | A2]\ncolumn-parallel", split="cols", parts=("A1", "A2"))
    ax.annotate("", xy=(4.3, 1.65), xytext=(3.7, 1.65), arrowprops=dict(arrowstyle="->"))
    matrix(ax, 4.4, 0.9, 2.0, 1.5, "Y = [Y1 | Y2], Y_r = GeLU(X A_r)\nlocal, no sync", split="cols",
           parts=("Y1", "Y2"))
    ax.text(6.65, 1.65, "x", fontsize=11, ha="center", va="center")
    matrix(ax, 6.9, 0.9, 1.2, 1.5, "B = [B1; B2]\nrow-parallel", split="rows", parts=("B1", "B2"))
    ax.annotate("", xy=(8.8, 1.65), xytext=(8.2, 1.65), arrowprops=dict(arrowstyle="->"))
    ax.text(9.05, 1.65, "g", fontsize=13, ha="center", va="center", weight="bold")
    matrix(ax, 9.3, 0.9, 1.0, 1.5, "Z = Y1 B1 + Y2 B2\n(all ranks)", parts="Z")
    ax.text(5.15, 2.85, "f: identity forward, all-reduce backward     g: all-reduce forward, identity backward",
            ha="center", fontsize=9)
    ax.text(5.15, 0.0, "rank 0 holds the blue halves, rank 1 the orange ones: one all-reduce each way",
            ha="center", fontsize=9)
    ax.set_xlim(-0.1, 10.4)
    ax.set_ylim(-0.1, 3.1)
    ax.axis("off")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


def sequence_parallel_figure(path):
    fig, ax = plt.subplots(figsize=(9.5, 2.9))
    stages = [("LayerNorm\n(B, T/N, C)", "seq"), ("all-gather\nT", None),
              ("column-parallel, GeLU\n(B, T, 4C/N)", "hid"),
              ("row-parallel: each rank\na whole partial sum\n(B, T, C)", "sum"),
              ("reduce-scatter\nT", None), ("dropout + residual\n(B, T/N, C)", "seq")]
    x = 0.0
    for label, kind in stages:
        if kind is None:
            ax.annotate("", xy=(x + 1.1, 1.0), xytext=(x, 1.0), arrowprops=dict(arrowstyle="->", lw=1.5))
            ax.text(x + 0.55, 1.35, label, ha="center", fontsize=8)
            x += 1.25
            continue
        for i, c in enumerate(RANKS):  # each rank's share: a slice of T or of the hidden size, or all
            if kind == "seq":
                ax.add_patch(Rectangle((x, 0.3 + (1 - i) * 0.7), 1.4, 0.7, fc=c, alpha=0.35, ec="k"))
            elif kind == "hid":
                ax.add_patch(Rectangle((x + i * 0.7, 0.3), 0.7, 1.4, fc=c, alpha=0.35, ec="k"))
            else:  # full T and full C on every rank, one behind the other: the sum is of the two
                at = (x + 0.12 * (1 - i), 0.3 + 0.12 * (1 - i))
                ax.add_patch(Rectangle(at, 1.28, 1.28, fc="white", ec="none"))
                ax.add_patch(Rectangle(at, 1.28, 1.28, fc=c, alpha=0.35, ec="k"))
        ax.text(x + 0.7, -0.05, label, ha="center", va="top", fontsize=8)
        x += 1.6
    ax.text(x / 2, 2.0, "sequence-parallel regions split T; tensor-parallel regions split the hidden size;"
            "\nthe reduce-scatter sums the partial sums and splits the result along T",
            ha="center", fontsize=9)
    ax.set_xlim(-0.1, x)
    ax.set_ylim(-0.9, 2.4)
    ax.axis("off")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    mlp_figure(os.path.join(HERE, "tp_mlp.png"))
    sequence_parallel_figure(os.path.join(HERE, "sequence_parallel.png"))

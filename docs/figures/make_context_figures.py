"""Draw the ring-attention picture of docs/context_parallel.md: python docs/figures/make_context_figures.py

The sequence is cut into 2 CP chunks. A cell (query chunk, key chunk) is computed by the rank that
holds the query chunk, at the ring step when the key chunk's owner's block reaches it (step
(rank - owner) mod CP); cells wholly in the future are skipped, diagonal ones are half masked.
"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Polygon, Rectangle  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CP = 4
RANKS = ["tab:blue", "tab:orange", "tab:green", "tab:red"]


def owners(split):
    """The rank holding each of the 2 CP chunks."""
    if split == "balanced":  # rank r: chunks r and 2CP-1-r (Megatron-core)
        return [min(c, 2 * CP - 1 - c) for c in range(2 * CP)]
    return [c // 2 for c in range(2 * CP)]  # rank r: chunks 2r and 2r+1


def panel(ax, split, title):
    owner = owners(split)
    work = [0.0] * CP
    n = 2 * CP
    for q in range(n):
        for k in range(q + 1):
            rank, step = owner[q], (owner[q] - owner[k]) % CP
            y = n - 1 - q  # query chunk 0 at the top
            colour = dict(fc=RANKS[rank], alpha=0.25 + 0.15 * step, ec="k", lw=0.6)
            if k == q:  # the diagonal: the keys after each query are masked
                ax.add_patch(Polygon([(k, y), (k + 1, y), (k, y + 1)], **colour))
                work[rank] += 0.5
            else:
                ax.add_patch(Rectangle((k, y), 1, 1, **colour))
                work[rank] += 1
            ax.text(k + 0.5 - 0.18 * (k == q), y + 0.5 - 0.18 * (k == q), str(step), ha="center",
                    va="center", fontsize=8)
    for q in range(n):
        ax.text(-0.15, n - 0.5 - q, f"q{q} (rank {owner[q]})", ha="right", va="center", fontsize=8,
                color=RANKS[owner[q]])
        ax.text(q + 0.5, n + 0.15, f"k{q}", ha="center", va="bottom", fontsize=8, color=RANKS[owner[q]])
    ax.add_patch(Rectangle((0, 0), n, n, fill=False, ec="0.4"))
    busiest = max(work) / (sum(work) / CP)
    ax.text(n / 2, -0.5, "chunk pairs per rank: " + ", ".join(f"{w:g}" for w in work) +
            f"\nbusiest / mean = {busiest:.2f}", ha="center", va="top", fontsize=9)
    ax.set_title(title, fontsize=10)
    ax.set_xlim(-2.6, n + 0.2)
    ax.set_ylim(-1.8, n + 0.8)
    ax.set_aspect("equal")
    ax.axis("off")


def ring_figure(path):
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.6))
    panel(axes[0], "balanced", f"load-balanced: rank r holds chunks r and {2 * CP - 1}-r")
    panel(axes[1], "contiguous", "contiguous: rank r holds chunks 2r and 2r+1")
    fig.suptitle(f"CP = {CP}: which (query chunk, key chunk) pairs each rank computes; the number is "
                 "the ring step\n(step t: rank r holds the K,V of rank r-t; the colour is the rank; "
                 "blank pairs are in the future and skipped)", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    ring_figure(os.path.join(HERE, "context_ring.png"))

"""Draw the process-grid pictures of docs/communication.md: python docs/figures/make_grid_figures.py

Pipeline stages are columns, left to right; inside a stage, ranks stack in Megatron's order
(tensor-parallel rank fastest). Boxes outline tensor-parallel groups, coloured bars join a
data-parallel group, arrows follow a pipeline group from stage to stage.
"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

from minipar.parallel import Layout  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def draw(layout, path):
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    rows = tp * dp
    fig, ax = plt.subplots(figsize=(2.5 * pp + 1.6, 0.62 * rows + 1.4))
    colours = plt.get_cmap("tab10")
    for r in range(layout.world_size):
        t, _, d, p = layout.coords(r)
        x, y = 2.5 * p, rows - 1 - (d * tp + t)
        ax.add_patch(FancyBboxPatch((x, y + 0.1), 1.4, 0.8, boxstyle="round,pad=0.02",
                                    fc=colours(t % 10), alpha=0.25, ec="none"))
        ax.text(x + 0.7, y + 0.5, f"rank {r}\ntp{t} dp{d} pp{p}", ha="center", va="center", fontsize=8)
        if p + 1 < pp:  # the pipeline: this rank's activations go to the same (tp, dp) next stage
            ax.annotate("", xy=(x + 2.5, y + 0.5), xytext=(x + 1.62 + 0.14 * tp, y + 0.5),
                        arrowprops=dict(arrowstyle="->", color="0.45"))
    for p in range(pp):
        for d in range(dp):  # tensor-parallel groups: neighbours in rank order
            top = rows - 1 - d * tp
            ax.add_patch(FancyBboxPatch((2.5 * p - 0.08, top - tp + 1.02), 1.56, tp - 0.04,
                                        boxstyle="round,pad=0.03", fc="none", ec="k", lw=1.2))
        for t in range(tp):  # data-parallel groups: same tp rank, every dp replica
            ys = [rows - 1 - (d * tp + t) + 0.5 for d in range(dp)]
            ax.plot([2.5 * p + 1.6 + 0.14 * t] * dp, ys, "o-", color=colours(t % 10), ms=4, lw=2)
    ax.set_xlim(-0.3, 2.5 * pp)
    ax.set_ylim(-0.2, rows + 0.3)
    ax.axis("off")
    ax.set_title(f"{layout.world_size} ranks: TP={tp} x DP={dp} x PP={pp}   "
                 "(boxes: TP groups, bars: DP groups, arrows: pipeline)", fontsize=9)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    draw(Layout(tp=2, pp=2, dp=2), os.path.join(HERE, "grid_8_ranks.png"))
    draw(Layout(tp=2, pp=4, dp=2), os.path.join(HERE, "grid_16_ranks.png"))

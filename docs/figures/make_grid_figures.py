"""Draw the process-grid pictures of docs/3d_parallel.md: python docs/figures/make_grid_figures.py

Pipeline stages are columns, left to right; inside a stage, ranks stack in Megatron's order
(tensor-parallel rank fastest). Boxes outline tensor-parallel groups, coloured bars join a
data-parallel group, arrows follow a pipeline group from stage to stage. Each rank's box says what
it holds for lesson 06's GPT (4 blocks, 4 heads, hidden 64, vocabulary 256): its blocks, its share
of the heads, MLP columns and vocabulary. Shaded bands are nodes of 8 GPUs, as a launcher fills
them: consecutive ranks on the same node.
"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Rectangle  # noqa: E402

from minipar.parallel import Layout  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GPUS_PER_NODE = 8
N_LAYER, N_HEAD, HIDDEN, VOCAB = 4, 4, 4 * 64, 256  # lesson 06's GPT; HIDDEN: the MLP's columns
PITCH, WIDTH, ROW = 3.1, 2.2, 1.25  # column pitch, box width, row height


def share(name, total, tp, t):
    """'heads 2-3': the part of ``total`` that tensor-parallel rank t of tp holds."""
    n = total // tp
    return f"{name} {t * n}-{(t + 1) * n - 1}"


def holds(t, p, tp, pp):
    """The lines of a rank's box below its name: blocks (and the ends), then its shards."""
    per = N_LAYER // pp
    blocks = f"h.{p * per}" + (f"-{p * per + per - 1}" if per > 1 else "")
    ends = (["wte, wpe"] if p == 0 else []) + (["ln_f, head"] if p == pp - 1 else [])
    shard = f"{share('heads', N_HEAD, tp, t)}, {share('cols', HIDDEN, tp, t)}"
    vocab = [share("vocab", VOCAB, tp, t)] if ends else []
    return [" + ".join([blocks] + ends), shard] + vocab


def draw(layout, path):
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    rows = tp * dp
    fig, ax = plt.subplots(figsize=(2.3 * pp + 1.6, 0.95 * rows + 1.6))
    colours = plt.get_cmap("tab10")
    for node in range(-(-layout.world_size // GPUS_PER_NODE)):  # stages are whole nodes here
        stages = [p for p in range(pp) if layout.rank(tp=0, dp=0, pp=p) // GPUS_PER_NODE == node]
        x0, x1 = PITCH * stages[0] - 0.25, PITCH * stages[-1] + WIDTH + 0.6
        ax.add_patch(Rectangle((x0, -0.75), x1 - x0, ROW * rows + 0.85, fc="0.5" if node % 2 else "0.7",
                               alpha=0.12, ec="none"))
        first, last = node * GPUS_PER_NODE, min(layout.world_size, (node + 1) * GPUS_PER_NODE) - 1
        ax.text((x0 + x1) / 2, -0.5, f"node {node}: ranks {first}-{last}", ha="center", fontsize=9)
    for r in range(layout.world_size):
        t, _, d, p = layout.coords(r)
        x, y = PITCH * p, ROW * (rows - 1 - (d * tp + t))
        ax.add_patch(FancyBboxPatch((x, y + 0.08), WIDTH, ROW - 0.16, boxstyle="round,pad=0.02",
                                    fc=colours(t % 10), alpha=0.25, ec="none"))
        text = "\n".join([f"rank {r}  (tp{t} dp{d} pp{p})"] + holds(t, p, tp, pp))
        ax.text(x + WIDTH / 2, y + ROW / 2, text, ha="center", va="center", fontsize=7)
        if p + 1 < pp:  # the pipeline: this rank's activations go to the same (tp, dp) next stage
            ax.annotate("", xy=(x + PITCH, y + ROW / 2), xytext=(x + WIDTH + 0.22 + 0.14 * tp, y + ROW / 2),
                        arrowprops=dict(arrowstyle="->", color="0.45"))
    for p in range(pp):
        for d in range(dp):  # tensor-parallel groups: neighbours in rank order
            top = ROW * (rows - d * tp)
            ax.add_patch(FancyBboxPatch((PITCH * p - 0.08, top - ROW * tp + 0.02), WIDTH + 0.16, ROW * tp - 0.04,
                                        boxstyle="round,pad=0.03", fc="none", ec="k", lw=1.2))
        for t in range(tp):  # data-parallel groups: same tp rank, every dp replica
            ys = [ROW * (rows - 1 - (d * tp + t)) + ROW / 2 for d in range(dp)]
            ax.plot([PITCH * p + WIDTH + 0.2 + 0.14 * t] * dp, ys, "o-", color=colours(t % 10), ms=4, lw=2)
    ax.set_xlim(-0.35, PITCH * (pp - 1) + WIDTH + 0.8)
    ax.set_ylim(-0.8, ROW * rows + 0.2)
    ax.axis("off")
    ax.set_title(f"{layout.world_size} ranks: TP={tp} x DP={dp} x PP={pp}, lesson 06's GPT (4 blocks)\n"
                 "boxes: TP groups, bars: DP groups, arrows: pipeline; bands: nodes of 8 GPUs", fontsize=9)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    draw(Layout(tp=2, pp=2, dp=2), os.path.join(HERE, "grid_8_ranks.png"))
    draw(Layout(tp=2, pp=4, dp=2), os.path.join(HERE, "grid_16_ranks.png"))

"""Draw docs/figures/zero_memory.png: python docs/figures/make_zero_figure.py

Bytes per rank for training state under ZeRO stages 0-3, for a 7.5B-parameter model on 64
data-parallel ranks (the ZeRO paper's running example), counted two ways:

* the paper's (Rajbhandari et al. 2020), mixed precision: 2 bytes of fp16 weight, 2 of fp16
  gradient and 12 of fp32 optimizer state (master weight, m, v) per parameter; 120 / 31.4 / 16.6 /
  1.9 GB;
* minipar's, fp32 with no master copy: 4 bytes of weight, 4 of gradient, 8 of Adam m and v;
  120 / 60.9 / 31.4 / 1.9 GB. This is what lessons/05_zero.py measures.
"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

P, N = 7.5e9, 64
LABELS = ["stage 0\n(data parallel)", "stage 1\noptimizer\nsharded", "stage 2\n+ gradients",
          "stage 3\n+ weights"]


def stages(weight, grad, optim):
    """Bytes per parameter on one rank of (weights, gradients, optimizer state) for stages 0-3."""
    return [(weight, grad, optim), (weight, grad, optim / N), (weight, grad / N, optim / N),
            (weight / N, grad / N, optim / N)]


PANELS = [  # title, bytes per parameter by stage, names of the three parts
    ("the paper: mixed precision, 2 + 2 + 12 bytes", stages(2, 2, 12),
     ("fp16 weights", "fp16 gradients", "fp32 master weights, m, v")),
    ("minipar: fp32, 4 + 4 + 8 bytes, no master copy", stages(4, 4, 8),
     ("fp32 weights", "fp32 gradients", "fp32 Adam m and v")),
]


def main():
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, (title, per_param, parts) in zip(axes, PANELS):
        bottoms = [0.0] * len(LABELS)
        for i, (part, colour) in enumerate(zip(parts, ("tab:blue", "tab:orange", "tab:green"))):
            heights = [per_param[s][i] * P / 1e9 for s in range(len(LABELS))]
            ax.bar(LABELS, heights, bottom=bottoms, color=colour, label=part)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        for x, total in enumerate(bottoms):
            ax.text(x, total + 2, f"{total:.1f} GB", ha="center", fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.legend(frameon=False, fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    axes[0].set_ylabel("GB per rank")
    axes[0].set_ylim(0, 140)
    fig.suptitle(f"Training state per rank, 7.5B parameters, N = {N} data-parallel ranks", fontsize=11)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_memory.png")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

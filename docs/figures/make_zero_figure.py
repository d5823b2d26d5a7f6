"""Draw docs/figures/zero_memory.png: python docs/figures/make_zero_figure.py

Bytes per rank for training state under ZeRO stages 0-3, from the formulas for fp32 AdamW
(4 bytes of weight, 4 of gradient, 8 of moments per parameter), for a 7.5B-parameter model on 64
data-parallel ranks (the ZeRO paper's running example, there in mixed precision).
"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

P, N = 7.5e9, 64
STAGES = {  # bytes per parameter of (weights, gradients, optimizer state) on one rank
    "stage 0\n(data parallel)": (4, 4, 8),
    "stage 1\noptimizer sharded": (4, 4, 8 / N),
    "stage 2\n+ gradients": (4, 4 / N, 8 / N),
    "stage 3\n+ weights": (4 / N, 4 / N, 8 / N),
}


def main():
    fig, ax = plt.subplots(figsize=(7.5, 4))
    labels = list(STAGES)
    bottoms = [0.0] * len(labels)
    for i, (part, colour) in enumerate(zip(("weights", "gradients", "Adam m and v"),
                                           ("tab:blue", "tab:orange", "tab:green"))):
        heights = [STAGES[s][i] * P / 1e9 for s in labels]
        ax.bar(labels, heights, bottom=bottoms, color=colour, label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for x, total in enumerate(bottoms):
        ax.text(x, total + 2, f"{total:.1f} GB", ha="center", fontsize=9)
    ax.set_ylabel("GB per rank")
    ax.set_title(f"Training state per rank, fp32 AdamW, 7.5B parameters, N = {N}", fontsize=10)
    ax.legend(frameon=False)
    ax.set_ylim(0, max(bottoms) * 1.15)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_memory.png")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Pictures of a run, drawn with matplotlib without a display."""

import os


def plot_loss(train_losses, val_points, path, title="training loss"):
    """Train loss per step and validation estimates ((step, loss) pairs) as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(len(train_losses)), train_losses, lw=1, label="train")
    if val_points:
        steps, losses = zip(*val_points)
        ax.plot(steps, losses, "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)

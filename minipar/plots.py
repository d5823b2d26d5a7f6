"""Pictures of a run, drawn with matplotlib without a display."""

import os

# What matplotlib's Agg canvas writes without extra packages, for a message when it is missing.
COMMON_FORMATS = ("eps", "pdf", "png", "ps", "svg")


def path_problem(path):
    """Why ``plot_loss`` could not write ``path``, in words naming the fix, or None. Asked before
    training: matplotlib finds an unknown extension only when it saves, after the whole run, and
    without an extension it writes ``path.png``, a file of another name than the one asked for."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return (f"the loss curve needs matplotlib: pip install matplotlib (it writes "
                f"{', '.join('.' + f for f in COMMON_FORMATS)}), or ask for no picture")
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    extension = os.path.splitext(path)[1][1:].lower()
    if extension in formats:
        return None
    choices = ", ".join("." + f for f in formats)
    if not extension:
        return f"no extension to name the format (matplotlib would write {path}.png): end it with one of {choices}"
    return f"matplotlib cannot write a .{extension} file: end the name with one of {choices}"


def plot_loss(train_losses, val_points, path, title="training loss", first=0):
    """Train loss per step from step ``first`` (a resumed run's) and validation estimates ((step,
    loss) pairs) as a picture at ``path``, in the format its extension names (see ``path_problem``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(first, first + len(train_losses)), train_losses, lw=1, label="train")
    if val_points:
        steps, losses = zip(*val_points)
        ax.plot(steps, losses, "o-", label="validation")
    _save(plt, fig, ax, path, title, "cross-entropy (nats per byte)")


def plot_curves(curves, path, title="training loss", ylabel="cross-entropy (nats per byte)"):
    """Several loss curves side by side: ``curves`` is {label: loss per step}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in curves.items():
        ax.plot(range(len(losses)), losses, lw=1, label=label)
    _save(plt, fig, ax, path, title, ylabel)


def _save(plt, fig, ax, path, title, ylabel):
    """Label a loss plot's axes and write it (its folder made if need be)."""
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    except OSError as exc:  # a full disk: a write's error names no file
        exc.filename = exc.filename or path
        raise
    finally:
        plt.close(fig)

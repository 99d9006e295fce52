"""Loss curves of fairseq-train logs (``--log-format simple``) and their plot, for
fairseq-rope-plot-losses and gpu_check's training section."""

from fairseq_rope_base.files import write_atomically
from fairseq_rope_tools.training_log import parse_train_log


def parse_log(path, subset="valid"):
    """Return ({update: train loss}, {update: valid loss}) from a fairseq-train log."""
    with open(path, encoding="utf-8", errors="replace") as f:
        parsed = parse_train_log(f, subset)
    return ({update: loss for update, loss in parsed["train_curve"]},
            {update: loss for update, loss, _ in parsed["valid_curve"]})


def plot_loss_curves(runs, output, title=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, train, valid) in enumerate(runs):
        c = colors[i % len(colors)]
        prefix = f"{label} " if label else ""
        if train:
            ax.plot(list(train), list(train.values()), color=c, alpha=0.8, label=f"{prefix}train")
        if valid:
            ax.plot(list(valid), list(valid.values()), color=c, linestyle="--", marker="o", markersize=3,
                    label=f"{prefix}valid")
    ax.set_xlabel("update")
    ax.set_ylabel("loss (label-smoothed cross-entropy, base 2)")
    ax.set_title(title or "fairseq-train loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        # format named: the temporary file's name does not end in .png
        write_atomically(output, lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)

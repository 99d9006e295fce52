#!/usr/bin/env python3
"""Redraw RoFormer's Fig. 2: the relative upper bound of the RoPE inner product against the
relative distance (Section 3.4.3, eqs. 35-37), straight from the formula.

Usage: ``fairseq-rope-plot-decay --out rope_decay.png [--dim 128] [--max-distance 256]``
"""

import logging

import torch

from fairseq_rope.modules.rotary import inverse_frequencies
from fairseq_rope_tools.cli import ArgumentParser, command


def relative_upper_bound(relative_distance, rotary_dim: int, theta: float = 10000.0):
    """(1/(d/2)) sum_{j=1}^{d/2} |S_j| with S_j = sum_{k<j} e^{i (m-n) theta_k}: the long-term
    decay bound of Section 3.4.3 (eqs. 35-37, Fig. 2), as a function of the relative distance."""
    inv_freq = inverse_frequencies(rotary_dim, theta).double()
    phases = relative_distance.double().unsqueeze(-1) * inv_freq
    partial_sums = torch.cumsum(torch.polar(torch.ones_like(phases), phases), dim=-1)
    return partial_sums.abs().mean(dim=-1)


@command
def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--dim", type=int, default=128, help="rotary dimension d (even)")
    p.add_argument("--theta", type=float, nargs="+", default=[10000.0], help="RoPE base(s), one curve each")
    p.add_argument("--max-distance", type=int, default=256)
    p.add_argument("--csv", help="also write distance,bound columns here")
    args = p.parse_args(argv)
    if args.dim <= 0 or args.dim % 2:
        p.error(f"--dim must be a positive even integer, got {args.dim}")

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    distance = torch.arange(args.max_distance + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    curves = {}
    for theta in args.theta:
        bound = relative_upper_bound(distance, args.dim, theta)
        curves[theta] = bound
        ax.plot(distance.numpy(), bound.numpy(), label=f"base {theta:g}")
    ax.set_xlabel("relative distance")
    ax.set_ylabel("relative upper bound")
    ax.set_title(f"Long-term decay of RoPE (d = {args.dim})")
    ax.grid(alpha=0.3)
    if len(args.theta) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("distance," + ",".join(f"bound_base_{t:g}" for t in args.theta) + "\n")
            for i in range(len(distance)):
                f.write(f"{i}," + ",".join(f"{curves[t][i].item():.6f}" for t in args.theta) + "\n")
    first = curves[args.theta[0]]
    print(f"wrote {args.out}: bound {first[0].item():.2f} at distance 0, "
          f"{first[-1].item():.2f} at distance {args.max_distance}")


if __name__ == "__main__":
    main()

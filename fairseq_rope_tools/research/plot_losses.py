#!/usr/bin/env python3
"""Plot training and validation loss per update from a fairseq-train log (``--log-format simple``).

    fairseq-rope-plot-losses work/quickstart/checkpoints/transformer_rope_tiny/train.log \\
        --output loss.png [--label RoPE] [--log other/train.log --label baseline]

Reads the ``train_inner`` lines and the validation lines of ``--subset`` with
:func:`fairseq_rope_tools.training_log.parse_train_log`: for a resumed run, the last value logged
for an update wins. Writes a PNG with matplotlib's Agg backend (no display needed)
and prints its path.
"""

import os

from fairseq_rope_base.files import outputs_over_inputs_problem
from fairseq_rope_tools.cli import ArgumentParser, UserError, command
from fairseq_rope_tools.research.loss_plots import parse_log, plot_loss_curves


@command
def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="*", help="fairseq-train log file(s)")
    p.add_argument("--log", action="append", default=[], help="another log (same as a positional one)")
    p.add_argument("--label", action="append", default=[], help="legend label for each log, in order")
    p.add_argument("--output", "-o", required=True, help="PNG file to write")
    p.add_argument("--title")
    p.add_argument("--subset", default="valid", help="validation subset name in the log")
    args = p.parse_args(argv)
    logs = args.logs + args.log
    if not logs:
        p.error("give at least one log file")
    problem = outputs_over_inputs_problem({"--output": args.output}, {"LOG": logs})
    if problem:
        raise UserError(problem)
    runs = []
    for i, path in enumerate(logs):
        train, valid = parse_log(path, args.subset)
        if not train and not valid:
            raise UserError(f"no train_inner or valid lines in {path}; was it written by fairseq-train "
                            "with --log-format simple?", status=1)
        label = (args.label[i] if i < len(args.label)
                 else os.path.basename(os.path.dirname(path)) if len(logs) > 1 else "")
        runs.append((label, train, valid))
    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    plot_loss_curves(runs, args.output, args.title)
    print(os.path.abspath(args.output))


if __name__ == "__main__":
    main()

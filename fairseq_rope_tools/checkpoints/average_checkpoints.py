#!/usr/bin/env python3
"""Average the parameters of several fairseq checkpoints into one.

Same command line as fairseq's ``fairseq-rope-average``::

    # the last 5 update checkpoints (checkpoint_EPOCH_UPDATES.pt) of a directory
    fairseq-rope-average --inputs checkpoints/ --num-update-checkpoints 5 \\
        --output checkpoints/checkpoint.avg5.pt
    # the last 5 epoch checkpoints (checkpointEPOCH.pt), none after epoch 40
    fairseq-rope-average --inputs checkpoints/ --num-epoch-checkpoints 5 \\
        --checkpoint-upper-bound 40 --output avg.pt
    # an explicit list
    fairseq-rope-average --inputs a.pt b.pt c.pt --output avg.pt

Checkpoints are loaded with ``weights_only=True`` where torch has the allow-list (2.4 and later;
before, they are unpickled in full: average only checkpoints you trust; importing
``fairseq_rope`` allow-lists the few types fairseq checkpoints hold), those in torch's legacy
format (before torch 1.6) too. All inputs must be the same model: the same parameter names and
shapes, the same value of every option that changes what the weights compute (architecture,
dimensions, every ``rope_*`` / ``rpe_*`` option, attention kind), and the same source and target
dictionaries (the plugin records a fingerprint of each in every checkpoint it writes; for an older
checkpoint, those of the data-bin its configuration names, where they still are, else a warning:
dictionaries of one size in other orders give parameters of the same shapes that mean other
tokens); otherwise the script stops and names what differs and both files.
Floating-point parameters are averaged in float64 and stored in their original dtype. The output keeps the first
checkpoint's configuration, with the training lengths of all inputs merged (the longest, and per
length the largest count: see ``fairseq_rope/training_lengths.py``), and training state (its
optimizer state is dropped unless ``--keep-optimizer-state``), and the inputs' dictionary
fingerprints, and the names of the files it averages. An ``--output`` that is a directory, one of
the inputs (symlinks followed) or an existing file this tool did not write (a training's
checkpoint) is refused before any checkpoint is averaged. The output is written atomically: to a hidden
temporary file in the output directory, fsynced and renamed when complete. The temporary file is
removed on any error and on SIGINT or SIGTERM; one left by SIGKILL matches no checkpoint name and is
removed by the next write of the same output.
"""

import argparse
import collections
import os
import re
import sys

import torch

from fairseq_rope.checkpoint_files import model_config
from fairseq_rope.checkpoint_safe_globals import safe_load_kwargs
from fairseq_rope.checkpoints import (
    DICTIONARIES,
    dictionaries_of,
    is_legacy_checkpoint,
    is_readable_checkpoint,
    load_cheaply,
    save_checkpoint_atomically,
)
from fairseq_rope.model_options import computation_options
from fairseq_rope.training_lengths import TrainingLengths
from fairseq_rope_base.files import output_dir_problem, outputs_over_inputs_problem
from fairseq_rope_tools.cli import ArgumentParser, UserError, command

EPOCH_RE = re.compile(r"^checkpoint(\d+)\.pt$")
UPDATE_RE = re.compile(r"^checkpoint_\d+_(\d+)\.pt$")


def last_n_checkpoints(directory, n, update_based, upper_bound=None):
    """Paths of the ``n`` newest epoch (``checkpointE.pt``) or update (``checkpoint_E_U.pt``)
    checkpoints of ``directory``, newest first, ignoring those above ``upper_bound``."""
    pattern = UPDATE_RE if update_based else EPOCH_RE
    found = []
    for name in os.listdir(directory):
        m = pattern.match(name)
        if m:
            number = int(m.group(1))
            if upper_bound is None or number <= upper_bound:
                found.append((number, os.path.join(directory, name)))
    kind = "update" if update_based else "epoch"
    if len(found) < n:
        raise UserError(
            f"found {len(found)} {kind} checkpoints in {directory}"
            + (f" up to {upper_bound}" if upper_bound is not None else "")
            + f", need {n}: {sorted(p for _, p in found) or 'none'}", status=1)
    return [p for _, p in sorted(found, reverse=True)[:n]]


def load_checkpoint(path):
    try:  # opened once: the file checked is the file loaded, even if the path is replaced meanwhile
        f = open(path, "rb")
    except FileNotFoundError:
        raise UserError(f"cannot load {path}: the file disappeared after it was listed (deleted or "
                        "renamed: is a training still writing to that directory?)", status=1) from None
    except OSError as e:
        raise UserError(f"cannot load {path}: {e.strerror}", status=1) from e
    with f:
        legacy = is_legacy_checkpoint(f)
        if not (legacy or is_readable_checkpoint(f)):
            raise UserError(
                f"cannot load {path}: not a checkpoint (truncated, or not a file torch.save wrote)", status=1)
        try:
            f.seek(0)
            state = torch.load(f, map_location="cpu", **safe_load_kwargs(torch.serialization))
        except Exception as e:  # noqa: BLE001 - report which file and why
            if legacy:  # its first bytes are right, its end is not: the legacy format has no directory to check
                raise UserError(f"cannot load {path}: a checkpoint in torch's legacy format (saved before torch "
                                "1.6) that does not load: truncated? Copy it again from where it was saved",
                                status=1) from e
            detail = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise UserError(f"cannot load {path}: {type(e).__name__}: {detail}", status=1) from e
    if not isinstance(state, dict) or "model" not in state:
        raise UserError(f"{path} is not a fairseq checkpoint (no 'model' entry)", status=1)
    return state


def average_checkpoints(paths):
    """Return a checkpoint dict whose ``model`` is the element-wise mean over ``paths``."""
    if not paths:
        raise ValueError("no checkpoints to average")
    first_path, first = paths[0], None
    sums, dtypes, options = collections.OrderedDict(), {}, None
    model_configs = []
    dictionaries = None  # (path, record): the first input whose dictionaries are known
    unchecked = []  # inputs that record no dictionaries, whose data-bin is gone too
    for path in paths:
        state = load_checkpoint(path)
        params = state["model"]
        model_configs.append(model_config(state))
        record = dictionaries_of(state)
        if record is None:
            unchecked.append(path)
        dictionaries = check_same_dictionaries(dictionaries, path, record)
        if first is None:
            first, options = state, computation_options(model_config(state))
            for k, v in params.items():
                dtypes[k] = v.dtype
                sums[k] = v.detach().to(torch.float64 if v.is_floating_point() else torch.int64).clone()
            continue
        check_same_model(options, computation_options(model_config(state)), first_path, path)
        missing = [k for k in sums if k not in params]
        extra = [k for k in params if k not in sums]
        if missing or extra:
            raise UserError(
                f"{path} has different parameter names than {first_path}: "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}", status=1)
        for k, v in params.items():
            if tuple(v.shape) != tuple(sums[k].shape):
                raise UserError(
                    f"{path}: parameter {k} has shape {tuple(v.shape)}, "
                    f"but {tuple(sums[k].shape)} in {first_path}", status=1)
            sums[k] += v.detach().to(sums[k].dtype)
        del state, params
    if unchecked and len(paths) > 1:
        print(f"warning: {', '.join(unchecked)} record no dictionaries (saved before fairseq-rope recorded them) and "
              "the data-bin their configuration names is gone: their dictionaries are not compared with the "
              "others'; average only checkpoints of one training", file=sys.stderr)
    n = len(paths)
    averaged = collections.OrderedDict()
    for k, total in sums.items():
        if total.is_floating_point():
            averaged[k] = (total / n).to(dtypes[k])
        else:  # integer buffers (e.g. version counters): floor division, as fairseq does
            averaged[k] = torch.div(total, n, rounding_mode="floor").to(dtypes[k])
    first["model"] = averaged
    first[AVERAGE_OF] = [os.path.basename(path) for path in paths]
    # the average has been trained on everything any input has seen
    TrainingLengths.merged(model_configs).record_in(model_config(first))
    if dictionaries is not None:
        first[DICTIONARIES] = dictionaries[1]
    return first


def check_same_model(first_options, options, first_path, path):
    for name, value in options.items():
        if value != first_options[name]:
            what = "architecture" if name == "arch" else name
            raise UserError(
                f"{path} has {what} {value!r}, but {first_path} has {first_options[name]!r}: "
                "they are not the same model and cannot be averaged", status=1)


def check_same_dictionaries(recorded, path, record):
    """``recorded``: (path, record) of the first input whose dictionaries' fingerprints are known,
    or None; ``record``: those of ``path``, recorded or from its data-bin (None: unknown, nothing to
    compare). Returns the new ``recorded``."""
    if not isinstance(record, dict):
        return recorded
    if recorded is None:
        return path, record
    first_path, first = recorded
    for side in ("source", "target"):
        if record.get(side) and first.get(side) and record[side] != first[side]:
            raise UserError(
                f"{path} was trained with another {side} dictionary than {first_path} (fingerprints "
                f"{record[side][:12]} and {first[side][:12]}): a token id means another token in each, so they "
                "cannot be averaged; average the checkpoints of one training", status=1)
    return recorded


# the key an average records its inputs under (their file names): a file without it, a training's
# checkpoint say, is not this tool's to replace
AVERAGE_OF = "fairseq_rope_average_of"


def is_average(path) -> bool:
    """Whether ``path`` is a checkpoint this tool wrote (tensors mapped, not read)."""
    try:
        return AVERAGE_OF in load_cheaply(path)
    except Exception:  # noqa: BLE001 - not a checkpoint at all, or not a readable one
        return False


def output_problem(output, inputs):
    """Why ``--output`` cannot take the average, as one line, or None; checked before any work."""
    if os.path.isdir(output):
        return f"--output {output} is a directory: give the file to write the average to"
    problem = (outputs_over_inputs_problem({"--output": output}, {"--inputs": list(inputs)})
               or output_dir_problem(f"--output {output}: directory", os.path.dirname(os.path.abspath(output))))
    if problem is None and os.path.exists(output) and not is_average(output):
        problem = (f"--output {output} exists and is not an average fairseq-rope-average wrote: give a new file, "
                   "or remove it first if it may go")
    return problem


@command
def main(argv=None):
    p = ArgumentParser(
        description="Average the parameters of several fairseq checkpoints.",
        epilog="For raw text through fairseq-interactive or from_pretrained, put an average in fairseq's\n"
               "pretrained-model layout (model.pt, dict.*.txt, bpecodes):\n"
               "    fairseq-rope-pretrained-layout --checkpoint AVG.pt --work-dir WORK_DIR\n"
               "(examples/wmt14_en_de/average.sh runs both; docs/usage.md#raw-text-through-fairseqs-own-tools)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--inputs", required=True, nargs="+",
                   help="checkpoint files, or one directory with --num-*-checkpoints")
    p.add_argument("--output", required=True, metavar="FILE", help="where to write the average")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--num-epoch-checkpoints", type=int,
                       help="average the last N checkpointEPOCH.pt files of the --inputs directory")
    group.add_argument("--num-update-checkpoints", type=int,
                       help="average the last N checkpoint_EPOCH_UPDATES.pt files of the --inputs directory")
    p.add_argument("--checkpoint-upper-bound", type=int,
                   help="ignore checkpoints after this epoch (or update, with --num-update-checkpoints)")
    p.add_argument("--keep-optimizer-state", action="store_true",
                   help="keep the first input's optimizer state in the output (dropped by default)")
    args = p.parse_args(argv)

    n = args.num_epoch_checkpoints or args.num_update_checkpoints
    if args.checkpoint_upper_bound is not None and n is None:
        p.error("--checkpoint-upper-bound needs --num-epoch-checkpoints or --num-update-checkpoints")
    if n is not None:
        if n < 1:
            p.error("the number of checkpoints to average must be at least 1")
        if len(args.inputs) != 1 or not os.path.isdir(args.inputs[0]):
            p.error("--num-epoch-checkpoints / --num-update-checkpoints need exactly one directory in --inputs")
        inputs = last_n_checkpoints(args.inputs[0], n, args.num_update_checkpoints is not None,
                                    args.checkpoint_upper_bound)
    else:
        inputs = args.inputs
        for path in inputs:
            if not os.path.isfile(path):
                raise UserError(f"{path} is not a file (for a directory, add --num-update-checkpoints N "
                                "or --num-epoch-checkpoints N)", status=1)
    problem = output_problem(args.output, inputs)
    if problem:
        raise UserError(problem)
    print(f"averaging {len(inputs)} checkpoints:", *inputs, sep="\n  ", file=sys.stderr)
    state = average_checkpoints(inputs)
    if not args.keep_optimizer_state:
        state["last_optimizer_state"] = None
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    try:
        save_checkpoint_atomically(state, args.output)
    except OSError as e:
        raise UserError(str(e), status=1) from e
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()

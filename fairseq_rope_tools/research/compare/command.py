#!/usr/bin/env python3
"""Compare position encodings for translation under identical conditions, in one command.

Every variant is trained by the recipe, examples/wmt14_en_de/train.sh, with the same
hyper-parameters, update budget and seeds; the harness sets only the budget (MAX_UPDATE, LR,
WARMUP_UPDATES, one batch per update, checkpoint interval) and the architecture, and any other
knob of train.sh set in the environment (LABEL_SMOOTHING=0.2 ...) reaches every run alike. The
last ``--average-last`` update checkpoints are averaged (fairseq-rope-average), the
average is decoded with beam 4 and length penalty 0.6, and scored as fairseq-rope-score
scores: tokenized BLEU with compound splitting, detokenized sacreBLEU and chrF++. Output in
``--out-dir``:

* ``results.md`` -- per test group and variant: each score as mean, sample std and per-seed
  values over seeds; per seed, each score with its 95 % bootstrap confidence interval and the
  p-value of sacreBLEU's paired bootstrap test against ``--baseline`` (fairseq_rope_tools/research/significance.py);
  for the joined groups, the sentence-split oracle of each decode and the share of it reached;
  validation loss, parameters, training speed; BLEU by source length; each decode's decoding time;
* ``results.json`` -- every number of every run, and the significance tests;
* ``valid_loss.png``, ``bleu_by_length.png``;
* ``text/`` and ``data-bin/`` where it binarizes the corpus itself, marked as its own: it replaces
  no text/ or data-bin/ it did not make, and writes into no prepare.sh work dir and over none of
  its inputs (refused before any work, docs/harness.md);
* ``runs/VARIANT/seedN/``: ``train.log`` (written as the training runs), ``generate*.log``, the
  hypotheses, ``result.json``. A rerun reuses finished runs made with the same settings, and the
  trained model of a run whose decoding settings alone changed (only the changed decodes are made),
  and resumes an interrupted training from its last checkpoint (``training.json`` records its
  settings and the seconds it has run).

While it runs it prints a line per logged training interval (update, losses, elapsed time, ETA)
and the decoding's progress. ``--jobs N`` runs N trainings at once: the CPU threads are split
evenly among them, or each gets a GPU of its own when GPUs are visible; with the same seeds and
threads per training the numbers are those of one training at a time.

Variants: ``sinusoidal``, ``learned``, ``none`` (stock fairseq ``transformer``), ``rpe``
(Shaw et al. 2018, ``transformer_rpe``), ``rope``, ``roper`` (``--rope-values``),
``rope_linear`` (``--attention-kind linear``): the encodings, the default; ``rope_cross``
(``--rope-cross-attention``), named only; and the training recipes for long inputs, named only:
``sinusoidal_concat``, ``rope_concat`` and ``rope_cross_concat`` (concatenation
training, train.sh's ``CONCAT_MAX_SENTENCES``: ``--concat-max-sentences``, ``--concat-prob``,
``--concat-from-epoch``),
``rope_randpos`` (``--rope-random-positions R``), ``rope_concat_randpos`` (both); a recipe's
variant with settings of its own is ``NAME@OPTION=VALUE[,...]`` (``rope_concat@concat-max-sentences=8``),
so that one report compares several settings of a recipe against one baseline. Any variant can
also start from another's trained model and have a budget of its own:
``rope_cross_concat@init-from=sinusoidal,max-update=375[,warmup-updates=N]`` fine-tunes the
averaged ``sinusoidal`` model of the same seed (train.sh's ``INIT_FROM``) for 375 updates, its
warm-up and checkpoint interval those of a 375-update training unless given; the report lists the
updates each model cost with its start's. Data
(fairseq_rope_tools/research/compare/data.py): ``--prepared-dir WORK_DIR`` (a corpus prepared by
prepare.sh), ``--quickstart-corpus`` (the synthetic corpus, prepared by prepare.sh here),
``--raw-dir DIR`` (whitespace-tokenized text) or ``--data-bin DIR``.
``--length-split L`` trains on pairs of at most L words and tests on longer ones and on test
pairs joined N at a time for each N of ``--joined-groups`` (2 3 by default), each joined group
also scored by its sentence-split oracle: the same decode's hypotheses of the single sentences,
joined as the sources were. RoPE variants can also be decoded with frequency scaling, the
same checkpoint through ``--model-overrides``: one factor for every sentence
(``--extrapolation-scaling yarn:4``) or one per sentence from its length
(``--extrapolation-scaling dynamic-yarn``). ``--ctranslate2-length-buckets`` also decodes RoPE
variants through CTranslate2 as dynamic-yarn is deployed there: the averaged model exported with
``fairseq-rope-export --length-buckets`` and each test sentence decoded by the model of its length
(``fairseq-rope-translate``). Every decode records its decoding time (model loading excluded).

Example::

    fairseq-rope-compare --quickstart-corpus --out-dir work/compare \\
        --variants sinusoidal rope --seeds 1 2 3 --max-update 3000 --length-split 20 \\
        --extrapolation-scaling ntk:3 yarn:3 dynamic-yarn --train-args "--encoder-embed-dim 128 --decoder-embed-dim 128"

``--train-args`` and ``--generate-args`` take one string of extra arguments, the same for every
variant; a single option can follow directly: ``--generate-args --remove-bpe``.
"""

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path

from fairseq_rope_base.files import output_dir_problem
from fairseq_rope_tools.cli import ArgumentParser, UserError, children_end_with_this_process, command
from fairseq_rope_tools.research.compare import data as compare_data
from fairseq_rope_tools.research.compare import report as compare_report
from fairseq_rope_tools.research.compare.progress import log
from fairseq_rope_tools.research.compare.runs import run_settings
from fairseq_rope_tools.research.compare.schedule import run_all
from fairseq_rope_tools.research.compare.variants import (
    ENCODINGS,
    RECIPE_OPTIONS,
    SIZES,
    VARIANTS,
    budget_defaults,
    parse_variant,
    recipe_readers,
    recipe_value_problem,
    start_of,
    variant_spec,
)

PASS_THROUGH = ("--train-args", "--generate-args")


QUICKSTART_DEFAULTS = {"corpus_train_size": 20000, "corpus_seed": 1, "corpus_bpe_size": 2000}


def attach_pass_through_values(argv):
    """``--generate-args --remove-bpe`` -> ``--generate-args=--remove-bpe``: argparse takes a
    value that starts with ``--`` for an option of its own and stops with 'expected one argument'."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in PASS_THROUGH and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def check_extrapolation_scalings(p, specs) -> None:
    """--extrapolation-scaling METHOD:FACTOR for a kind that takes a factor, METHOD alone for a
    per-sentence one, as their ScalingSpecs say (read only when asked for: the registry is the
    plugin's, and importing it loads fairseq)."""
    from fairseq_rope.modules.rope_scaling import ROPE_SCALINGS, per_sentence_scalings

    scaled = [name for name, spec in ROPE_SCALINGS.items() if spec.takes_factor]
    per_sentence = per_sentence_scalings()
    for spec in specs:
        method, _, factor = spec.partition(":")
        if method in per_sentence and not factor:
            continue
        if method not in scaled or not re.fullmatch(r"\d+(\.\d+)?", factor or ""):
            p.error(f"--extrapolation-scaling expects METHOD:FACTOR with METHOD {', '.join(scaled)}, "
                    f"or {' or '.join(per_sentence)} alone; got {spec!r}")


def check_options_take_effect(p, args) -> None:
    """An option that would change nothing is refused, not ignored: the user believes it did."""
    rope = [v for v in args.variants if variant_spec(v).family == "transformer_rope"]
    if (args.extrapolation_scaling or args.ctranslate2_length_buckets is not None) and not rope:
        p.error("--extrapolation-scaling and --ctranslate2-length-buckets decode the RoPE variants only, and "
                "--variants names none: add rope (roper, rope_linear), or drop them")
    if args.rope_scaling_original_length is not None:
        if args.rope_scaling_original_length <= 0:
            p.error(f"--rope-scaling-original-length must be a number of tokens > 0, got "
                    f"{args.rope_scaling_original_length}")
        if args.ctranslate2_length_buckets is None and not any(
                needs_training_length(spec) for spec in args.extrapolation_scaling):
            p.error("--rope-scaling-original-length is read only by yarn and the dynamic kinds of "
                    "--extrapolation-scaling and by --ctranslate2-length-buckets, and none is asked for: "
                    "add one, or drop it")
    check_recipe_options(p, args)
    if args.joined_groups is not None and not args.length_split:
        p.error("--joined-groups names the test groups of --length-split, which is not asked for: add it, or drop "
                "--joined-groups")
    args.joined_groups = sorted(set(args.joined_groups or [2, 3]))
    if args.joined_groups[0] < 2:
        p.error(f"--joined-groups: each is a number N >= 2 of test sentences joined into one input, got "
                f"{args.joined_groups[0]}")
    if args.gen_subset != "test" and not args.data_bin:
        p.error(f"--gen-subset {args.gen_subset}: the references of --raw-dir, --prepared-dir and "
                "--quickstart-corpus are their test set's; decode another subset of a --data-bin")
    given = ["--" + name.replace("_", "-") for name in QUICKSTART_DEFAULTS if getattr(args, name) is not None]
    if given and not args.quickstart_corpus:
        p.error(f"{', '.join(given)}: the options of --quickstart-corpus, which is not asked for; drop them")
    for name, default in QUICKSTART_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def check_recipe_options(p, args) -> None:
    """The options of the training recipes (:data:`RECIPE_OPTIONS`): refused when no variant
    reads them, or when every variant that does sets its own; else checked and given their defaults."""
    for name, option in RECIPE_OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        readers = [v for v in args.variants if getattr(variant_spec(v), option.recipe)]
        if getattr(args, name) is None:
            setattr(args, name, option.default)
        elif not readers:
            p.error(f"{flag} is read by the variants {' '.join(recipe_readers(name))}, and --variants names none: "
                    "add one, or drop it")
        elif all(name in args.variant_settings[v] for v in readers):
            p.error(f"{flag} is read by no variant of --variants: {' '.join(readers)} set their own; drop it")
        problem = recipe_value_problem(name, getattr(args, name))
        if problem:
            p.error(f"{flag} {problem}")


def check_starts(p, args) -> None:
    """init-from names a variant of --variants (a plain name: it starts from scratch itself)."""
    for variant in args.variants:
        start = start_of(args, variant)
        if start and start not in args.variants:
            p.error(f"--variants {variant}: init-from={start} is not among --variants: add {start} "
                    "(its model, trained with the same seed, is the start)")


def needs_training_length(spec) -> bool:
    """Whether --extrapolation-scaling SPEC reads the training length L (yarn, the dynamic kinds)."""
    from fairseq_rope.modules.rope_scaling import scaling_spec

    return scaling_spec(spec.partition(":")[0]).needs_training_length


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--prepared-dir", type=Path, metavar="WORK_DIR", help="a corpus prepared by prepare.sh")
    data.add_argument("--quickstart-corpus", action="store_true", help="generate the synthetic corpus and prepare it")
    data.add_argument("--raw-dir", type=Path, help="whitespace-tokenized {train,valid,test}.{SRC,TGT}")
    data.add_argument("--data-bin", type=Path, help="an existing fairseq data-bin (joined dictionary)")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--source-lang", default="en")
    p.add_argument("--target-lang", default="de")
    p.add_argument("--corpus-train-size", type=int, help="--quickstart-corpus training pairs (default 20000)")
    p.add_argument("--corpus-seed", type=int, help="--quickstart-corpus seed (default 1)")
    p.add_argument("--corpus-bpe-size", type=int, help="--quickstart-corpus BPE merges (default 2000)")
    p.add_argument("--variants", nargs="+", default=ENCODINGS, metavar="VARIANT",
                   help=f"any of {' '.join(VARIANTS)} (default: the encodings, {' '.join(ENCODINGS)}); a training "
                        "recipe's variant with settings of its own: NAME@OPTION=VALUE[,OPTION=VALUE] with OPTIONs "
                        "of the recipe's flags, e.g. rope_concat@concat-max-sentences=8,concat-prob=0.2; and a "
                        "start and budget of its own: init-from=VARIANT (that variant's model of the same seed, "
                        "fine-tuned), max-update=N, warmup-updates=N")
    p.add_argument("--baseline", default="sinusoidal", metavar="VARIANT",
                   help="the variant of --variants every other one is tested against (default sinusoidal)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--size", choices=list(SIZES), default="tiny", help="architecture size of every variant")
    p.add_argument("--max-update", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per batch (default: the recipe's)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-updates", type=int, default=None, help="default: max-update / 10")
    p.add_argument("--dropout", type=float, default=None, help="default: the recipe's")
    p.add_argument("--train-args", action="append", default=[], metavar="ARGS",
                   help="extra fairseq-train arguments, the same for every variant "
                        "(e.g. --train-args --report-accuracy)")
    p.add_argument("--generate-args", action="append", default=[], metavar="ARGS",
                   help="extra fairseq-generate arguments (e.g. --generate-args --remove-bpe)")
    p.add_argument("--save-interval-updates", type=int, default=None,
                   help="checkpoint (and validation) interval; default: max-update / (2 x average-last)")
    p.add_argument("--average-last", type=int, default=5, help="average this many last update checkpoints")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--lenpen", type=float, default=0.6)
    p.add_argument("--max-len-a", type=float, default=1.2, help="hypotheses have at most a x source + b tokens")
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--gen-subset", default="test")
    p.add_argument("--length-split", type=int, default=None, metavar="L",
                   help="train on pairs of at most L words; test on longer and concatenated ones (not with --data-bin)")
    p.add_argument("--joined-groups", nargs="+", type=int, default=None, metavar="N",
                   help="with --length-split: test on consecutive test pairs joined N at a time, a group per N, "
                        "each also scored by its sentence-split oracle (default: 2 3)")
    for name, option in RECIPE_OPTIONS.items():
        p.add_argument("--" + name.replace("_", "-"), type=option.type, default=None, metavar=option.metavar,
                       help=f"{option.does} (default {option.default:g}), unless they set their own")
    p.add_argument("--extrapolation-scaling", nargs="*", default=[], metavar="METHOD:FACTOR",
                   help="also decode RoPE variants with --rope-scaling METHOD and this factor, or METHOD "
                        "alone for a kind chosen per sentence (from its length and the training length the "
                        "checkpoint recorded); python -m fairseq_rope lists the kinds")
    p.add_argument("--ctranslate2-length-buckets", nargs="*", type=float, default=None, metavar="S",
                   help="also decode RoPE variants through CTranslate2, exported with fairseq-rope-export "
                        "--length-buckets S ... (default factors without S): dynamic-yarn at engine speed; needs "
                        "--max-len-a 0, and a corpus given as text (not --data-bin)")
    p.add_argument("--rope-scaling-original-length", type=int, default=None, metavar="L",
                   help="training length in tokens for yarn and the dynamic scalings (default: the one "
                        "each checkpoint recorded)")
    p.add_argument("--length-buckets", type=int, nargs="+", default=[10, 20, 30, 40],
                   help="upper edges of the source-length buckets")
    p.add_argument("--jobs", type=int, default=1, help="trainings at once (at most one per GPU)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads of each run (default: cores / jobs)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the per-update checkpoints")
    p.add_argument("--overwrite", action="store_true", help="rerun runs that already have a result")
    args = p.parse_args(attach_pass_through_values(list(sys.argv[1:] if argv is None else argv)))
    args.train_args = [a for value in args.train_args for a in shlex.split(value)]
    args.generate_args = [a for value in args.generate_args for a in shlex.split(value)]
    args.variant_settings = {}  # {canonical name: its own recipe settings}

    def canonical(flag, text):
        try:
            name, own = parse_variant(text)
        except ValueError as e:
            p.error(f"{flag} {text}: {e}")
        args.variant_settings[name] = own
        return name

    args.variants = [canonical("--variants", text) for text in args.variants]
    args.baseline = canonical("--baseline", args.baseline)
    if args.length_split and args.data_bin:
        p.error("--length-split needs text (--prepared-dir, --quickstart-corpus or --raw-dir), not --data-bin")
    if args.extrapolation_scaling:
        check_extrapolation_scalings(p, args.extrapolation_scaling)
    if args.ctranslate2_length_buckets is not None:
        if args.max_len_a != 0:
            p.error("--ctranslate2-length-buckets: CTranslate2 caps hypotheses at an absolute length; pass "
                    "--max-len-a 0 (and --max-len-b N), so that both engines stop at the same length")
        if args.data_bin:
            p.error("--ctranslate2-length-buckets needs the test source as text: --prepared-dir, "
                    "--quickstart-corpus or --raw-dir, not --data-bin")
    check_options_take_effect(p, args)
    check_starts(p, args)
    if args.baseline not in args.variants:
        p.error(f"--baseline {args.baseline} is not among --variants {' '.join(args.variants)}: add it, "
                "or name one of them with --baseline")
    if args.jobs < 1 or (args.threads is not None and args.threads < 1):
        p.error("--jobs and --threads must be at least 1")
    problem = output_dir_problem("--out-dir", args.out_dir)  # before any work, not at the first write
    if problem:
        p.error(problem)
    if args.threads is None:
        args.threads = max(1, len(os.sched_getaffinity(0)) // args.jobs)
    args.given_budget = [name for name in ("warmup_updates", "save_interval_updates")
                         if getattr(args, name) is not None]
    for name, default in budget_defaults(args.max_update, args.average_last).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.variants = [args.baseline] + [v for v in dict.fromkeys(args.variants) if v != args.baseline]
    source = next((k, getattr(args, k)) for k in ("prepared_dir", "raw_dir", "data_bin", "quickstart_corpus")
                  if getattr(args, k))
    args.data_source = {"source": source[0], "path": str(source[1]), "length_split": args.length_split,
                        **({"corpus": [args.corpus_seed, args.corpus_train_size, args.corpus_bpe_size]}
                           if args.quickstart_corpus else {})}
    trained = {}
    for variant in args.variants:
        same = trained.setdefault(json.dumps(run_settings(args, variant, 0), sort_keys=True), variant)
        if same != variant:
            p.error(f"--variants {same} and {variant} train the same model: drop one")
    return args


def harness_outputs(args):
    """Everything the harness writes in --out-dir, by how a message names it."""
    written = {f"--out-dir's {name}": args.out_dir / name for name in ("runs/", *compare_report.WRITTEN)}
    return {**written, **compare_data.written_paths(args)}


@command
def main(argv=None):
    args = parse_args(argv)
    args.out_dir = args.out_dir.resolve()
    problem = compare_data.out_dir_problem(args, harness_outputs(args))
    if problem:
        raise UserError(problem)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with children_end_with_this_process():
        data = compare_data.prepare(args, log)
        results = run_all(args, data)
    report = compare_report.build(args, data, results)
    compare_report.write(args, report)
    log(f"wrote {args.out_dir / 'results.md'}, results.json and the plots")
    print((args.out_dir / "results.md").read_text())


if __name__ == "__main__":
    main()

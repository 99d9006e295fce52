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
(fairseq_rope_tools/research/compare_data.py): ``--prepared-dir WORK_DIR`` (a corpus prepared by
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
import math
import os
import queue
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, List, NamedTuple

from fairseq_rope_files import file_fingerprint, output_dir_problem, write_lines_atomically, write_text_atomically
from fairseq_rope_tools.checkpoints import score_bleu
from fairseq_rope_tools.cli import (
    ArgumentParser,
    CommandFailed,
    UserError,
    children_end_with_this_process,
    command,
    duration,
    plugin_dir,
    run_logged,
    terminate_running,
)
from fairseq_rope_tools.deploy.segmentation import remove_bpe
from fairseq_rope_tools.recipes import recipe_step
from fairseq_rope_tools.research import compare_data, compare_report
from fairseq_rope_tools.text_lines import read_lines
from fairseq_rope_tools.training_log import parse_train_line, parse_train_log

TRAIN_SH = recipe_step("wmt14_en_de", "train.sh")
RESULT_FORMAT = 3  # format 2 is upgraded (its trained model kept, its decodes redone); older is rerun

class Variant(NamedTuple):
    family: str  # mapped to an architecture by --size
    flags: List[str]
    concatenation: bool = False  # trained with concatenation (train.sh's CONCAT_MAX_SENTENCES)
    random_positions: bool = False  # trained with --rope-random-positions
    named_only: bool = False  # an encoding that runs only when --variants names it


VARIANTS = {
    "sinusoidal": Variant("transformer", []),
    "learned": Variant("transformer", ["--encoder-learned-pos", "--decoder-learned-pos"]),
    "none": Variant("transformer", ["--no-token-positional-embeddings"]),
    "rpe": Variant("transformer_rpe", []),
    "rope": Variant("transformer_rope", []),
    "roper": Variant("transformer_rope", ["--rope-values"]),
    "rope_linear": Variant("transformer_rope", ["--attention-kind", "linear"]),
    # encoder-decoder attention rotated too: its scores see the distance between target and source positions
    "rope_cross": Variant("transformer_rope", ["--rope-cross-attention"], named_only=True),
    # the training recipes for inputs longer than the training pairs (docs/position_encodings.md)
    "sinusoidal_concat": Variant("transformer", [], concatenation=True),
    "rope_concat": Variant("transformer_rope", [], concatenation=True),
    "rope_randpos": Variant("transformer_rope", [], random_positions=True),
    "rope_concat_randpos": Variant("transformer_rope", [], concatenation=True, random_positions=True),
    "rope_cross_concat": Variant("transformer_rope", ["--rope-cross-attention"], concatenation=True),
}
ENCODINGS = [name for name, v in VARIANTS.items()  # the default
             if not (v.concatenation or v.random_positions or v.named_only)]


class RecipeOption(NamedTuple):
    recipe: str  # the Variant field of the variants that read it
    default: float
    type: type
    valid: Callable[[float], bool]
    requirement: str  # what a valid value is, for the message that refuses another


# the options of the recipes: each is refused when no variant of --variants reads it; a variant
# can set its own (VARIANT@OPTION=VALUE,...: parse_variant)
RECIPE_OPTIONS = {
    "concat_max_sentences": RecipeOption("concatenation", 3, int, lambda k: k >= 2,
                                         "a number K >= 2 of sentences joined at most"),
    "concat_prob": RecipeOption("concatenation", 0.5, float, lambda p: 0.0 < p <= 1.0, "a probability in (0, 1]"),
    "concat_from_epoch": RecipeOption("concatenation", 1, int, lambda e: e >= 1, "an epoch number >= 1"),
    "rope_random_positions": RecipeOption("random_positions", 4.0, float, lambda r: math.isfinite(r) and r > 1.0,
                                          "a number R > 1 (the range of positions, R times a sequence's length)"),
}


class RunOption(NamedTuple):
    type: type
    valid: Callable[[object], bool]
    requirement: str


# what any variant can set as its own: where its training starts and how long it runs. A variant
# with init-from=OTHER starts from OTHER's averaged model of the same seed (train.sh's INIT_FROM),
# so that "OTHER, then fine-tuned into this" is compared in one report with this from scratch;
# with its own max-update its warm-up and checkpoint interval default to that budget's.
RUN_OPTIONS = {
    "init_from": RunOption(str, lambda name: name in VARIANTS, "the plain name of another variant of --variants"),
    "max_update": RunOption(int, lambda n: n >= 1, "a number of updates >= 1"),
    "warmup_updates": RunOption(int, lambda n: n >= 0, "a number of updates >= 0"),
}
OWN_SETTINGS = "@"  # rope_concat@concat-max-sentences=8: rope_concat, trained with its own K


def base_variant(variant) -> str:
    """The variant of :data:`VARIANTS` a name of --variants is (``rope_concat@concat-max-sentences=8``:
    ``rope_concat``)."""
    return variant.partition(OWN_SETTINGS)[0]


def variant_spec(variant) -> Variant:
    """The Variant a name of --variants trains."""
    return VARIANTS[base_variant(variant)]


def parse_variant(text):
    """A name of --variants, ``NAME`` or ``NAME@OPTION=VALUE[,OPTION=VALUE]`` with OPTIONs of
    :data:`RECIPE_OPTIONS` that NAME reads and of :data:`RUN_OPTIONS`: (its canonical name,
    {option: value}). A ValueError says what is wrong."""
    base, own_settings, settings = text.partition(OWN_SETTINGS)
    if base not in VARIANTS:
        raise ValueError(f"unknown variant {base!r}: choose from {', '.join(VARIANTS)}")
    own = {}
    for item in settings.split(",") if own_settings else []:
        flag, is_set, value = item.partition("=")
        name = flag.replace("-", "_")
        if not is_set or name not in {**RECIPE_OPTIONS, **RUN_OPTIONS}:
            raise ValueError(f"{item!r} is not OPTION=VALUE with OPTION one of "
                             + ", ".join(n.replace("_", "-") for n in {**RECIPE_OPTIONS, **RUN_OPTIONS}))
        if name in RECIPE_OPTIONS and not getattr(VARIANTS[base], RECIPE_OPTIONS[name].recipe):
            raise ValueError(f"{base} reads no {flag}: it is an option of the variants "
                             + " ".join(recipe_readers(name)))
        if name in own:
            raise ValueError(f"{flag} is given twice")
        option = RECIPE_OPTIONS.get(name) or RUN_OPTIONS[name]
        try:
            own[name] = option.type(value)
        except ValueError:
            kind = "a whole number" if option.type is int else "a number"
            raise ValueError(f"{flag} takes {kind}, got {value!r}") from None
        problem = recipe_value_problem(name, own[name])
        if problem:
            raise ValueError(f"{flag} {problem}")
    canonical = ",".join(f"{n.replace('_', '-')}={own[n]:g}" if not isinstance(own[n], str)
                         else f"{n.replace('_', '-')}={own[n]}"
                         for n in (*RECIPE_OPTIONS, *RUN_OPTIONS) if n in own)
    return (f"{base}{OWN_SETTINGS}{canonical}" if own else base), own


def recipe_readers(name):
    """The variants that read the recipe option ``name``."""
    return [v for v, spec in VARIANTS.items() if getattr(spec, RECIPE_OPTIONS[name].recipe)]


def recipe_value_problem(name, value):
    """What is wrong with ``value`` for the recipe or run option ``name`` (None: nothing)."""
    option = RECIPE_OPTIONS.get(name) or RUN_OPTIONS[name]
    shown = value if isinstance(value, str) else f"{value:g}"
    return None if option.valid(value) else f"must be {option.requirement}, got {shown}"


def recipe_value(args, variant, name):
    """The value of the recipe option ``name`` a variant trains with: its own, else the flag's."""
    return args.variant_settings.get(variant, {}).get(name, getattr(args, name))


def start_of(args, variant):
    """The variant of --variants whose averaged model ``variant`` starts from (None: from scratch)."""
    return args.variant_settings.get(variant, {}).get("init_from")


def run_value(args, variant, name):
    """The training budget ``name`` (max_update, warmup_updates, save_interval_updates) a variant
    trains with: its own; else the flag's when given, or its default from the variant's max-update."""
    own = args.variant_settings.get(variant, {})
    if name in own:
        return own[name]
    if name != "max_update" and "max_update" in own and name not in args.given_budget:
        return budget_defaults(own["max_update"], args.average_last)[name]
    return getattr(args, name)


def budget_defaults(max_update, average_last):
    """The warm-up and checkpoint interval of a training of ``max_update`` updates when not given."""
    return {"warmup_updates": max(1, max_update // 10),
            "save_interval_updates": max(1, max_update // (2 * average_last))}


def in_training_order(args):
    """--variants in their order, but each start before the first variant that starts from it."""
    ordered = []
    for variant in args.variants:
        ordered += [v for v in (start_of(args, variant), variant) if v and v not in ordered]
    return ordered


SIZES = {
    "tiny": {"transformer": "transformer_tiny", "transformer_rope": "transformer_rope_tiny",
             "transformer_rpe": "transformer_rpe_tiny"},
    "base": {"transformer": "transformer", "transformer_rope": "transformer_rope",
             "transformer_rpe": "transformer_rpe"},
    "wmt_en_de": {"transformer": "transformer_wmt_en_de", "transformer_rope": "transformer_rope_wmt_en_de",
                  "transformer_rpe": "transformer_rpe_wmt_en_de"},
}
PASS_THROUGH = ("--train-args", "--generate-args")
QUICKSTART_DEFAULTS = {"corpus_train_size": 20000, "corpus_seed": 1, "corpus_bpe_size": 2000}
_print_lock = threading.Lock()


def log(message):
    with _print_lock:
        print(f"[compare] {message}", flush=True)


# ---------------------------------------------------------------------------------- progress


class TrainingProgress:
    """fairseq-train's log condensed to one line per logged interval and per validation. A
    resumed training counts the ``seconds_before`` of its earlier attempts in the elapsed time;
    ``on_elapsed(seconds)`` is told the total at each logged line."""

    def __init__(self, name, total_updates, seconds_before=0.0, on_elapsed=None):
        self.name, self.total, self.started = name, total_updates, time.time()
        self.seconds_before, self.on_elapsed = seconds_before, on_elapsed
        self.first_update = None  # the ETA comes from this attempt's pace alone
        self.valid_loss = None

    def elapsed(self):
        return self.seconds_before + time.time() - self.started

    def __call__(self, line):
        parsed = parse_train_line(line)
        if parsed is None or parsed[0] not in ("train_inner", "valid"):
            return
        kind, fields = parsed
        update = int(fields["num_updates"])
        if self.first_update is None:
            self.first_update = update - 1 if kind == "train_inner" else update
        if kind == "valid":
            self.valid_loss = fields.get("loss")
        elapsed, done = self.elapsed(), update - self.first_update
        eta = (time.time() - self.started) / done * (self.total - update) if done > 0 else math.nan
        if self.on_elapsed is not None:
            self.on_elapsed(elapsed)
        train = f"train loss {fields['loss']:.3f}" if kind == "train_inner" and "loss" in fields else "validation"
        valid = f"valid loss {self.valid_loss:.3f}" if self.valid_loss is not None else "valid loss -"
        log(f"{self.name}: update {update}/{self.total} | {train} | {valid} | {duration(elapsed)} elapsed"
            + (f", ETA {duration(eta)}" if update < self.total and not math.isnan(eta) else ""))


class Decoding:
    """Collects fairseq-generate's S/T/H lines by sentence id and reports every tenth of the way."""

    def __init__(self, name, expected):
        self.name, self.expected, self.started = name, expected, time.time()
        self.rows, self.translated, self.reported = {}, 0, 0

    def __call__(self, line):
        kind, _, rest = line.partition("-")
        if kind not in ("S", "T", "H") or "\t" not in rest:
            return
        fields = rest.split("\t")
        if not fields[0].isdigit():
            return
        self.rows.setdefault(int(fields[0]), {})[kind] = fields[-1]
        if kind != "H":
            return
        self.translated += 1
        if self.expected and self.translated * 10 // self.expected > self.reported:
            self.reported = self.translated * 10 // self.expected
            log(f"{self.name}: {self.translated}/{self.expected} sentences ({duration(time.time() - self.started)})")

    def in_order(self):
        """[(source, hypothesis, reference)] by sentence id."""
        return [(r.get("S", ""), r.get("H", ""), r.get("T", "")) for _, r in sorted(self.rows.items())]


# ---------------------------------------------------------------------------------- one run


def run_settings(args, variant, seed, start_sha256=None):
    """Everything that decides a run's trained model (the threads per training aside); each
    decode's own settings are :func:`decode_settings`. A variant that starts from another's model
    is decided by that model too: ``start_sha256``, its averaged.pt's (given once it is trained)."""
    spec = variant_spec(variant)
    flags = spec.flags + (["--rope-random-positions", f"{recipe_value(args, variant, 'rope_random_positions'):g}"]
                          if spec.random_positions else [])
    # the variant that names the model, its own settings in flags and recipe_env: a run of
    # rope_concat@concat-max-sentences=3 is a run of rope_concat with --concat-max-sentences 3
    settings = {"variant": base_variant(variant), "seed": seed, "arch": SIZES[args.size][spec.family],
                "flags": flags, "recipe_env": recipe_env(args, variant), "train_args": args.train_args,
                "average_last": args.average_last, "data": args.data_source}
    if start_of(args, variant):  # only then: the settings of the runs from scratch stay those made before
        settings["init_from"] = {"variant": start_of(args, variant), "sha256": start_sha256}
    return settings


def start_checkpoint(args, variant, seed):
    """The averaged model of the run ``variant`` of ``seed`` starts from."""
    return args.out_dir / "runs" / start_of(args, variant) / f"seed{seed}" / "averaged.pt"


def recipe_env(args, variant):
    """The knobs of examples/wmt14_en_de/train.sh the comparison sets for a variant (all else:
    its defaults)."""
    max_update = run_value(args, variant, "max_update")
    env = {"MAX_UPDATE": max_update, "LR": args.lr, "WARMUP_UPDATES": run_value(args, variant, "warmup_updates"),
           "UPDATE_FREQ": 1, "SAVE_INTERVAL_UPDATES": run_value(args, variant, "save_interval_updates"),
           "KEEP_INTERVAL_UPDATES": args.average_last,
           # a progress line every 2 % of the way, at most every 100 updates (the recipe's interval)
           "LOG_INTERVAL": min(100, max(1, max_update // 50)),
           "NUM_WORKERS": 0}
    if args.max_tokens:
        env["MAX_TOKENS"] = args.max_tokens
    if args.dropout is not None:
        env["DROPOUT"] = args.dropout
    if variant_spec(variant).concatenation:
        env.update(CONCAT_MAX_SENTENCES=recipe_value(args, variant, "concat_max_sentences"),
                   CONCAT_PROB=f"{recipe_value(args, variant, 'concat_prob'):g}")
        if recipe_value(args, variant, "concat_from_epoch") > 1:  # else the settings of the runs made before it
            env["CONCAT_FROM_EPOCH"] = recipe_value(args, variant, "concat_from_epoch")
    return {k: str(v) for k, v in env.items()}


def average_last(save_dir, k, output, log_path):
    """Average the last k update checkpoints with fairseq-rope-average."""
    found = [p for p in os.listdir(save_dir) if re.match(r"^checkpoint_\d+_\d+\.pt$", p)]
    n = min(k, len(found))
    if n == 0:
        shutil.copy(save_dir / "checkpoint_last.pt", output)
        return 1
    run_logged(["fairseq-rope-average", "--inputs", save_dir,
                "--num-update-checkpoints", n, "--output", output], log_path)
    return n


def extra_decodes(args, variant):
    """{row suffix: --model-overrides} of the decodes of a variant: the plain one, and RoPE
    frequency scalings."""
    decodes = {"": None}
    if variant_spec(variant).family == "transformer_rope" and args.extrapolation_scaling:
        from fairseq_rope.modules.rope_scaling import scaling_spec

        for spec in args.extrapolation_scaling:
            method, _, factor = spec.partition(":")
            # yarn and the dynamic kinds read the training length L (in tokens) the checkpoint
            # recorded, the same L for all of them, unless --rope-scaling-original-length names one
            scaling = scaling_spec(method)
            overrides = {"rope_scaling": method}
            if scaling.takes_factor:
                overrides["rope_scaling_factor"] = float(factor)
            if scaling.needs_training_length and args.rope_scaling_original_length:
                overrides["rope_scaling_original_length"] = args.rope_scaling_original_length
            decodes[f"+{method}x{float(factor):g}" if scaling.takes_factor else f"+{method}"] = overrides
    return decodes


CT2_BUCKETS = "+ctranslate2-buckets"  # the row suffix of the CTranslate2 length-bucket decode


def decode_settings(args, overrides):
    """Everything that decides the numbers of one decode of a trained run (the joined groups
    decide the test set)."""
    settings = {"overrides": overrides, "generate_args": args.generate_args,
                "decoding": [args.beam, args.lenpen, args.max_len_a, args.max_len_b]}
    if args.length_split:
        settings["joined_groups"] = args.joined_groups
    return settings


def wanted_decodes(args, variant):
    """{row suffix: decode settings} of a variant: fairseq-generate's (:func:`extra_decodes`) and, for
    RoPE with --ctranslate2-length-buckets, CTranslate2's."""
    wanted = {suffix: decode_settings(args, overrides) for suffix, overrides in extra_decodes(args, variant).items()}
    if args.ctranslate2_length_buckets is not None and variant_spec(variant).family == "transformer_rope":
        wanted[CT2_BUCKETS] = {**decode_settings(args, None), "engine": "ctranslate2",
                               "length_buckets": args.ctranslate2_length_buckets}
        if args.rope_scaling_original_length:  # the buckets' training length, as for fairseq's decodes
            wanted[CT2_BUCKETS]["rope_scaling_original_length"] = args.rope_scaling_original_length
    return wanted


def decode_with_ctranslate2(args, data, checkpoint, settings, log_path, name, slot, run_dir):
    """:func:`decode` through CTranslate2: the averaged model exported with --length-buckets, each
    sentence of the BPE'd test source decoded by the model of its length. Hypotheses have at most
    --max-len-b tokens (--max-len-a is 0: CTranslate2 caps lengths absolutely)."""
    export_dir, out = run_dir / "ct2_length_buckets", run_dir / f"hyp{CT2_BUCKETS}.bpe.txt"
    stats_file = run_dir / f"speed{CT2_BUCKETS}.json"
    training_length = settings.get("rope_scaling_original_length")
    log(f"{name}: exporting to CTranslate2, a model per length bucket")
    run_logged(["fairseq-rope-export", "--checkpoint", checkpoint, "--data-bin", data.data_bin, "--output-dir",
                export_dir, "--length-buckets", *settings["length_buckets"], "--if-changed", "--force",
                *(["--rope-scaling-original-length", training_length] if training_length else [])], log_path)
    log(f"{name}: decoding {args.gen_subset} with CTranslate2")
    run_logged(["fairseq-rope-translate", "--model-dir", export_dir, "--data-bin", data.data_bin,
                "--src", args.source_lang, "--tgt", args.target_lang, "--input-format", "bpe", "--output-format", "bpe",
                "--beam", args.beam, "--lenpen", args.lenpen, "--max-len", args.max_len_b, "--batch-size",
                args.batch_size, "--stats-json", stats_file, "--output", out,
                data.source_text], log_path, env=slot, append=True)
    words = (lambda line: remove_bpe(line, data.bpe_type)) if data.bpe_type else (lambda line: line)
    stats = json.loads(stats_file.read_text())
    return ([(words(s), words(h), None) for s, h in zip(read_lines(data.source_text), read_lines(out))],
            {"seconds": stats["seconds"], "buckets": stats["length_buckets"]["sentences"]})


def generate_seconds(log_path):
    """fairseq-generate's decoding time, model loading excluded ("Translated N sentences (...) in 12.3s")."""
    times = re.findall(r"Translated [\d,]+ sentences \([\d,]+ tokens\) in ([\d.]+)s", Path(log_path).read_text())
    return float(times[-1]) if times else None


def decode(args, data, checkpoint, overrides, log_path, name, slot):
    """Beam search on ``--gen-subset``: [(source, hypothesis, reference)] in test-set order,
    tokenized, subwords removed."""
    expected = max(end or 0 for _, end in data.groups.values())  # 0: a --data-bin subset of unknown size
    decoding = Decoding(name, expected)
    cmd = ["fairseq-generate", data.data_bin, "--user-dir", plugin_dir(), "--path", checkpoint,
           "--source-lang", args.source_lang, "--target-lang", args.target_lang, "--gen-subset", args.gen_subset,
           "--beam", args.beam, "--lenpen", args.lenpen, "--max-len-a", args.max_len_a, "--max-len-b", args.max_len_b,
           "--batch-size", args.batch_size, "--num-workers", "0",
           # fairseq 0.12's batch_by_size leaves out a final partial batch (n mod 8 sentences);
           # fairseq_rope restores it, and a multiple of 1 has no partial batch at all
           "--required-batch-size-multiple", "1", *data.generate_args, *args.generate_args]
    if overrides:
        cmd += ["--model-overrides", repr(overrides)]
    run_logged(cmd, log_path, env=slot, on_line=decoding)
    rows = decoding.in_order()
    if expected and len(rows) != expected:
        raise CommandFailed(f"fairseq-generate translated {len(rows)} of {expected} test sentences (see {log_path})")
    return rows


def score_decode(args, data, rows, refs_tok, refs_raw):
    """Scores of one decode per test group and tokenized BLEU by source length."""
    hyps = [h for _, h, _ in rows]
    detok = score_bleu.moses_detokenize(hyps, args.target_lang)
    scores = {"sentences": len(rows), "bleu": {}, "sacrebleu": {}, "chrf": {}}
    for group, (start, end) in data.groups.items():
        end = len(rows) if end is None else end
        result, _ = score_bleu.score_all(hyps[start:end], refs_tok[start:end], refs_raw[start:end],
                                         args.target_lang, detok_hyps=detok[start:end])
        scores["bleu"][group] = result["tokenized_bleu_compound_split"]["score"]
        scores["sacrebleu"][group] = result["sacrebleu"]["score"]
        scores["chrf"][group] = result["chrf++"]["score"]
        scores["signatures"] = {"sacrebleu": result["sacrebleu"]["signature"], "chrf": result["chrf++"]["signature"]}
    if data.joined:
        scores["oracle"] = {group: oracle_scores(args, scores, group, data.groups[group], parts, hyps, refs_tok,
                                                 refs_raw) for group, parts in data.joined.items()}
    edges = [0, *args.length_buckets, math.inf]
    scores["bleu_by_length"] = {}
    for lo, hi in zip(edges[:-1], edges[1:]):
        label = f"{lo + 1}-{hi}" if hi != math.inf else f">{lo}"
        picked = [i for i, (s, _, _) in enumerate(rows) if lo < len(s.split()) <= hi]
        bleu = score_bleu.tokenized_bleu([hyps[i] for i in picked], [refs_tok[i] for i in picked])[0].score \
            if picked else math.nan
        scores["bleu_by_length"][label] = {"bleu": bleu, "sentences": len(picked)}
    return scores, detok


def oracle_scores(args, scores, group, line_range, parts, hyps, refs_tok, refs_raw):
    """The sentence-split oracle of a joined group: the decode's own hypotheses of the single
    sentences, joined as their sources were, scored against the group's references; and the
    share of it the decode of the joined inputs reached (``ratio``, decoded / oracle; None where
    the oracle scores 0)."""
    start, end = line_range
    joined = [" ".join(hyps[line] for line in lines) for lines in parts]
    result, _ = score_bleu.score_all(joined, refs_tok[start:end], refs_raw[start:end], args.target_lang)
    oracle = {"bleu": result["tokenized_bleu_compound_split"]["score"], "sacrebleu": result["sacrebleu"]["score"],
              "chrf": result["chrf++"]["score"]}
    ratio = {key: scores[key][group] / score if score else None for key, score in oracle.items()}
    return {**oracle, "ratio": ratio}


def run_one(args, data, variant, seed, slot, start=None):
    """Train, average, decode and score one variant with one seed; ``slot``: the environment of
    the CPU threads or GPU this run may use; ``start``: the result of the run it starts from, if
    any. A run trained before with the same settings is not trained again: only the decodes that
    are new or decided by other settings are made."""
    name = f"{variant} seed {seed}"
    run_dir = args.out_dir / "runs" / variant / f"seed{seed}"
    result_file = run_dir / "result.json"
    averaged = run_dir / "averaged.pt"
    settings = run_settings(args, variant, seed,
                            start and file_fingerprint(start_checkpoint(args, variant, seed))[1])
    wanted = wanted_decodes(args, variant)
    started = time.time()
    result = json.loads(result_file.read_text()) if result_file.exists() and not args.overwrite else None
    if result and result.get("format") == 2:  # its settings held the decodes' too; those are redone
        for key in ("generate_args", "decoding", "extrapolation_scaling"):
            result["settings"].pop(key, None)
        result["format"] = RESULT_FORMAT
    if result and (result.get("format") != RESULT_FORMAT or result.get("settings") != settings
                   or not averaged.exists()):
        log(f"{name}: {result_file} was made by other settings or an older harness; running it again")
        result = None
    if result is None:
        result = train_and_average(args, data, name, run_dir, settings, averaged, slot,
                                   start and start_checkpoint(args, variant, seed))
    # the updates the model cost, its start's included (results before this record had no start)
    own_updates = int(settings["recipe_env"]["MAX_UPDATE"])
    updates = {"own": own_updates, "total": own_updates + (start["updates"]["total"] if start else 0)}
    if result.get("updates") != updates:
        result["updates"] = updates
        # saved now, so that a decode that fails or is interrupted does not cost the training
        write_text_atomically(result_file, json.dumps(result, indent=1))
    elif result.get("decode_settings") == wanted:
        log(f"{name}: done before, reusing {result_file}")
        return result
    else:
        log(f"{name}: reusing the trained model of {result_file}; decoding what is new or changed")
    done_before = result.get("decode_settings", {})
    decodes = {}
    for suffix, wanted_settings in wanted.items():
        if done_before.get(suffix) == wanted_settings:
            decodes[suffix] = result["decodes"][suffix]
            continue
        log_path = run_dir / f"generate{suffix}.log"
        if wanted_settings.get("engine") == "ctranslate2":
            rows, speed = decode_with_ctranslate2(args, data, averaged, wanted_settings, log_path,
                                                  f"{name}{suffix}", slot, run_dir)
        else:
            rows = decode(args, data, averaged, wanted_settings["overrides"], log_path,
                          f"{name}: decoding {args.gen_subset}{suffix}", slot)
            speed = {"seconds": generate_seconds(log_path)}
        refs_tok = data.refs_tok if data.refs_tok is not None else [t for _, _, t in rows]
        refs_raw = (data.refs_raw if data.refs_raw is not None
                    else score_bleu.moses_detokenize(refs_tok, args.target_lang))
        decodes[suffix], detok = score_decode(args, data, rows, refs_tok, refs_raw)
        decodes[suffix]["decoding_time"] = speed
        write_lines_atomically(run_dir / f"hyp{suffix}.tok.txt", (h for _, h, _ in rows))
        write_lines_atomically(run_dir / f"hyp{suffix}.detok.txt", detok)
        if data.refs_tok is None:
            write_lines_atomically(run_dir / "ref.tok.txt", refs_tok)
    for suffix in set(result["decodes"]) - set(wanted):  # no longer asked for: no stale files either
        for stale in (f"generate{suffix}.log", f"hyp{suffix}.tok.txt", f"hyp{suffix}.detok.txt",
                      f"hyp{suffix}.bpe.txt", f"speed{suffix}.json"):
            (run_dir / stale).unlink(missing_ok=True)
        if suffix == CT2_BUCKETS:
            shutil.rmtree(run_dir / "ct2_length_buckets", ignore_errors=True)
    result.update(decodes=decodes, decode_settings=wanted)
    write_text_atomically(result_file, json.dumps(result, indent=1))
    log(f"{name}: done in {duration(time.time() - started)}; tok BLEU "
        + ", ".join(f"{k} {v:.2f}" for k, v in decodes[""]["bleu"].items()))
    return result


def interrupted_training(run_dir, settings, overwrite):
    """Seconds an interrupted training of these settings in ``run_dir`` had run, if it can be
    resumed from its checkpoint_last.pt; else None."""
    progress_file = run_dir / "training.json"
    if overwrite or not (run_dir / "checkpoints" / "checkpoint_last.pt").exists() or not progress_file.exists():
        return None
    try:
        progress = json.loads(progress_file.read_text())
    except ValueError:
        return None
    return progress["seconds"] if progress.get("settings") == settings else None


def train_and_average(args, data, name, run_dir, settings, averaged, slot, init_from=None):
    """Train one run with the recipe (from the model ``init_from``, if given) and average its last
    checkpoints into ``averaged``: the run's result without decodes. An interrupted training of
    the same settings is resumed from its last checkpoint (train.sh resumes from
    checkpoint_last.pt), its log continued."""
    save_dir = run_dir / "checkpoints"
    progress_file = run_dir / "training.json"
    seconds_before = interrupted_training(run_dir, settings, args.overwrite)
    if seconds_before is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        save_dir.mkdir(parents=True)
        seconds_before = 0.0
        log(f"{name}: training {' '.join([settings['arch'], *settings['flags']])} for "
            f"{settings['recipe_env']['MAX_UPDATE']} updates" + (f" from {init_from}" if init_from else "") + " "
            f"(log: {run_dir / 'train.log'})")
    else:
        log(f"{name}: resuming its interrupted training from {save_dir / 'checkpoint_last.pt'} "
            f"(log: {run_dir / 'train.log'})")

    def record_elapsed(seconds):
        write_text_atomically(progress_file, json.dumps({"settings": settings, "seconds": seconds}))

    record_elapsed(seconds_before)
    progress = TrainingProgress(name, int(settings["recipe_env"]["MAX_UPDATE"]), seconds_before, record_elapsed)
    env = {**slot, **settings["recipe_env"], "DATA_BIN": str(data.data_bin), "SAVE_DIR": str(save_dir),
           "ARCH": settings["arch"], "SRC": args.source_lang, "TGT": args.target_lang, "SEED": str(settings["seed"]),
           "LOG_FILE": os.devnull}  # train.sh would tee into a log of its own; train.log is ours
    if init_from is not None:
        env["INIT_FROM"] = str(init_from)
    # through env(1), so that each attempt's first line in train.log is the complete command to rerun it by hand
    run_logged(["env", *(f"{k}={v}" for k, v in env.items()), "bash", TRAIN_SH, *settings["flags"], *args.train_args],
               run_dir / "train.log", name="train.sh", on_line=progress, append=True)
    with open(run_dir / "train.log", encoding="utf-8", errors="replace") as f:
        result = {"format": RESULT_FORMAT, "settings": settings, "variant": settings["variant"],
                  "seed": settings["seed"], "train_seconds": progress.elapsed(), **parse_train_log(f)}
    result["averaged_checkpoints"] = average_last(save_dir, args.average_last, averaged, run_dir / "average.log")
    if not args.keep_checkpoints:
        shutil.rmtree(save_dir)
    progress_file.unlink()
    result.update(decodes={}, decode_settings={})
    return result


# ---------------------------------------------------------------------------------- devices


def visible_gpus():
    """The CUDA_VISIBLE_DEVICES entries of the GPUs torch can use here ([] on a CPU machine)."""
    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidiactl"):
        return []  # no NVIDIA driver: spare the seconds of importing torch to ask
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True)
    count = int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return (listed or [str(i) for i in range(count)])[:count]


def job_slots(jobs, threads, gpus):
    """The environment of each of ``jobs`` concurrent runs: a GPU each while there are GPUs
    (then at most one run per GPU), else CPU threads only."""
    threads = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if gpus:
        return [{**threads, "CUDA_VISIBLE_DEVICES": gpu, "GPUS": "1", "CPU": "0"} for gpu in gpus[:jobs]]
    return [{**threads, "CUDA_VISIBLE_DEVICES": "", "GPUS": "0", "CPU": "1"} for _ in range(jobs)]


def run_all(args, data):
    """{variant: [result per seed]}, ``--jobs`` runs at a time."""
    slots = queue.Queue()
    planned = job_slots(args.jobs, args.threads, visible_gpus())
    for slot in planned:
        slots.put(slot)
    log(f"{len(args.variants) * len(args.seeds)} runs, {len(planned)} at a time, "
        f"{args.threads} CPU thread(s) each" + (", a GPU each" if planned[0]["GPUS"] == "1" else ""))

    futures = {}

    def run(variant, seed):
        # a run that starts from another waits for it without holding a slot; that run was
        # submitted before it, so a worker already has it (the pool takes its tasks in order)
        start = futures[(start_of(args, variant), seed)].result() if start_of(args, variant) else None
        slot = slots.get()
        try:
            return run_one(args, data, variant, seed, slot, start)
        finally:
            slots.put(slot)

    # seed by seed: the runs of one seed finish close together and under the same load, so a
    # comparison stopped half-way already has whole seeds to compare
    tasks = [(v, s) for s in args.seeds for v in in_training_order(args)]
    with ThreadPoolExecutor(max_workers=len(planned)) as pool:
        for task in tasks:
            futures[task] = pool.submit(run, *task)
        try:
            done = {task: future.result() for task, future in futures.items()}
        except BaseException as e:
            for future in futures.values():
                future.cancel()
            if isinstance(e, Exception):
                log("a run failed: the runs in progress finish first (a rerun reuses them)")
            else:  # interrupted: stop what runs
                terminate_running()
            raise
    return {v: [done[(v, s)] for s in args.seeds] for v in args.variants}


# ---------------------------------------------------------------------------------- main


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
    p.add_argument("--concat-max-sentences", type=int, default=None, metavar="K",
                   help="the variants with concat in their name join a training pair with 1 to K - 1 others "
                        "(default 3), unless they set their own")
    p.add_argument("--concat-prob", type=float, default=None, metavar="P",
                   help="the variants with concat in their name join this share of the training pairs with others "
                        "(default 0.5), unless they set their own")
    p.add_argument("--concat-from-epoch", type=int, default=None, metavar="E",
                   help="the variants with concat in their name join pairs from epoch E on (default 1), unless "
                        "they set their own")
    p.add_argument("--rope-random-positions", type=float, default=None, metavar="R",
                   help="the variants with randpos in their name train with --rope-random-positions R (default 4), "
                        "unless they set their own")
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

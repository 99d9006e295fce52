#!/usr/bin/env python3
"""Translate raw text with a trained model, through CTranslate2 or fairseq.

    fairseq-rope-translate --model-dir ct2/wmt14_en_de input.en -o output.de   # a bundle: nothing else needed
    some-producer | fairseq-rope-translate --model-dir ct2/wmt14_en_de         # each line answered as it comes
    fairseq-rope-translate --model-dir ct2/wmt14_en_de --nbest 4 --json-lines < input.en
    fairseq-rope-translate --work-dir work/wmt14_en_de --engine fairseq \\
        --checkpoint work/wmt14_en_de/checkpoints/transformer_rope_wmt_en_de/checkpoint.avg5.pt < input.en

``--model-dir`` is what fairseq-rope-export wrote: a bundle (``bundle.json``), which holds the
model (or one model per length bucket) and the recipe's segmentation, and is verified against its
manifest before anything is loaded: a bundle with a file changed, missing or added is refused in
one line. Each input line goes through the recipe's own steps (examples/wmt14_en_de/prepare.sh):
Moses punctuation normalisation, removal of non-printing characters and Moses tokenisation ``-a``
(skipped for a corpus prepared with --no-tokenize), then the BPE (subword-nmt codes with the
source vocabulary and its threshold, or sentencepiece), taken from the bundle, or from the
prepared work directory ``--work-dir`` (``tok/``, ``bpe/`` and ``data-bin/``) for an export
without them and for ``--engine fairseq``; a work dir given with a bundle must hold the very
segmentation the bundle holds. It is translated with beam search (beam 4, length penalty 0.6, at
most 200 tokens, as fairseq-generate in evaluate.sh), the BPE is removed as fairseq-generate's
``--remove-bpe`` does and the result is Moses-detokenized. One output line per input line, in
input order (``--nbest N``: N lines; ``--json-lines``: one JSON object with the scores;
fairseq_rope_tools/deploy/output.py gives the formats); an empty line gives an empty line.

A file is sorted by length into batches for speed. Standard input from a pipe or a terminal (or
a named pipe as the input), written to standard output, is translated as it comes: a batch is
decoded and flushed as soon as it is full or ``--flush-after`` seconds after its first line
came, so a line sent in gets its translation while the input stays open.

Input is read strictly (fairseq_rope_tools/text_lines.py): lines end only at ``\\n`` (CRLF is a plain end; a
``\\r`` or other line-break character inside a line becomes a space, reported), and the first
invalid UTF-8 byte stops the command with the file and line unless ``--replace-invalid-utf8``.
``--output`` is written atomically (a temporary file renamed when complete); without it the
translations go to stdout.

A line longer than the model's source positions (its BPE tokens and the ``</s>`` appended, as
fairseq counts them: ``max_source_positions`` of the checkpoint, or as the export recorded it) is
refused by default: the lines before it are translated and written, then the command stops
naming it (status 1); ``--too-long skip`` leaves its translation empty, ``--too-long truncate``
translates its first tokens, and either reports how many lines it affected;
``--max-source-positions`` sets another limit. A line is read only up to the bytes the limit can
hold (:func:`~fairseq_rope_tools.deploy.batching.line_byte_cap`): an endless line costs no memory.

Before anything is decoded, the CTranslate2 model's vocabularies must be the data-bin's
dictionaries token for token in order (when a data-bin is given), ``--src``/``--tgt`` the model's
direction, every output path writable (a symlinked ``--output`` keeps the link; its target is
replaced) and none of the files the run reads, and standard output open when the translations go
there.

A ``--model-dir`` written by ``fairseq-rope-export --length-buckets`` decodes as ``--rope-scaling
dynamic-yarn`` scales: each sentence goes to the model of its length (plain RoPE within the
training length L, static YaRN at the next factor up from its tokens / L beyond); the sentences
each bucket got are reported. Every bucket's ``export_info.json`` must record its checkpoint's
sha256, factor and L as the manifest lists them, and its vocabularies are checked as a single
export's are.

``--input-format bpe`` takes lines already tokenized and BPE'd (as ``bpe/test.SRC``) and
``--output-format tok`` writes Moses-tokenized hypotheses with the BPE removed (as ``hyp.tok.TGT``
of evaluate.sh): examples/wmt14_en_de/evaluate.sh decodes the test set this way with ENGINE=ctranslate2.

The command line only: the engines (fairseq_rope_tools/deploy/engine.py and its implementations),
the batching, the segmentation, the work dir's and the export's records and the output formats
each have a module of their own in fairseq_rope_tools/deploy/.
"""

import argparse
import importlib.util
import json
import os
import stat
import sys
from pathlib import Path

from fairseq_rope_files import output_files_problem, write_lines, write_text_atomically
from fairseq_rope_tools.cli import ArgumentParser, UserError, closed_stdout_problem, command, sayer
from fairseq_rope_tools.data import text_tools  # (the recipe's strict line reader)
from fairseq_rope_tools.deploy import exported, fairseq_engine, work_dir
from fairseq_rope_tools.deploy.batching import (
    TOO_LONG_POLICIES,
    LengthLimit,
    batches_as_they_come,
    line_byte_cap,
    translate_sorted,
)
from fairseq_rope_tools.deploy.engine import Decoding
from fairseq_rope_tools.deploy.output import OutputFormat
from fairseq_rope_tools.deploy.segmentation import OUTPUT_FORMATS, Segmenter, first_line
from fairseq_rope_tools.text_lines import OverlongLine

say = sayer("translate")


# --- the engines: each a function of the parsed flags -------------------------------------------
def open_ctranslate2(args):
    """A CTranslate2 export, or the router over a --length-buckets export's models."""
    from fairseq_rope_tools.deploy.ctranslate2_engine import CTranslate2Engine

    def open_model(model_dir):
        return CTranslate2Engine(model_dir, args.decoding, args.device, args.compute_type, args.threads)

    if exported.is_bucket_export(args.model_dir):
        from fairseq_rope_tools.deploy.length_buckets import LengthBuckets

        engine = LengthBuckets(args.model_dir, open_model, keep_loaded=args.streaming)
    else:
        engine = open_model(args.model_dir)
    engine.max_source = args.max_source_positions or recorded_limit(args.model_dir)  # of an export that loaded
    return engine


def open_fairseq(args):
    from fairseq_rope_tools.deploy.fairseq_engine import FairseqEngine

    return FairseqEngine(args.checkpoint, args.data_bin, args.src, args.tgt, args.decoding, args.device,
                         args.compute_type, args.threads, args.max_source_positions)


ENGINES = {"ctranslate2": open_ctranslate2, "fairseq": open_fairseq}


# --- input ----------------------------------------------------------------------------------------
class _Stdin(os.PathLike):
    """The path LineReader opens for standard input, named as such in its messages."""

    def __fspath__(self):
        return "/dev/stdin"

    def __str__(self):
        return "standard input"


def is_stream(path) -> bool:
    """Whether the input arrives over time (a pipe, a terminal, a socket), not a file read whole."""
    try:
        mode = os.fstat(0).st_mode if path == "-" else os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode)


def default_threads():
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else cores


def add_model_arguments(p):
    """The flags that choose the model, its segmentation and its beam search, which
    fairseq-rope-serve shares: the same bundle and flags give the same translations."""
    p.add_argument("--model-dir", help="what fairseq-rope-export wrote: a bundle (model and segmentation), or a "
                                       "directory of length buckets (--length-buckets)")
    p.add_argument("--work-dir", help="the directory prepare.sh wrote for the model: tok/, bpe/ and data-bin/ "
                                      "(for raw text with an export that holds no segmentation, and for --engine "
                                      "fairseq); with a bundle, checked to be its segmentation")
    p.add_argument("--data-bin", help="the model's data-bin: dictionaries, bpe_type, languages "
                                      "(default: WORK_DIR/data-bin)")
    p.add_argument("--src", help="source language (default: as the bundle or the data-bin records it)")
    p.add_argument("--tgt", help="target language (default: as the bundle or the data-bin records it)")
    p.add_argument("--beam", type=int, default=4, help="beam size (4)")
    p.add_argument("--lenpen", type=float, default=0.6, help="length penalty (0.6)")
    p.add_argument("--max-len", type=int, default=200,
                   help="at most this many target tokens per sentence (200, fairseq-generate's --max-len-b)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="CPU threads (default: $OMP_NUM_THREADS, else the cores this process may use)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--compute-type", default="default",
                   help="CTranslate2: default (the type the model was exported with: float32 unless exported "
                        "with --quantization), float32, int8, int8_float32, float16, bfloat16, ...; "
                        "fairseq: float32, or float16 / bfloat16 on cuda")
    p.add_argument("--max-source-positions", type=int,
                   help="the longest source the model takes, in BPE tokens plus the </s> appended to each "
                        "(default: the model's max_source_positions: from the checkpoint, or recorded by "
                        "fairseq-rope-export)")


def check_model_arguments(p, args, minimums=()):
    """argparse's refusal of the values of :func:`add_model_arguments`' flags (and of ``minimums``,
    (flag, least value) pairs of the command's own) that no model takes."""
    for flag, minimum in (("beam", 1), ("max_len", 1), ("threads", 1), ("max_source_positions", 2), *minimums):
        if getattr(args, flag) is not None and getattr(args, flag) < minimum:
            p.error(f"--{flag.replace('_', '-')} must be at least {minimum}, not {getattr(args, flag)}")
    if args.lenpen != args.lenpen:  # NaN
        p.error("--lenpen must be a number")


def parse_args(argv):
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", nargs="?", default="-", help="text to translate, one sentence per line (default: stdin)")
    p.add_argument("-o", "--output", help="write the translations here, atomically (default: stdout)")
    add_model_arguments(p)
    p.add_argument("--engine", choices=list(ENGINES),
                   help="ctranslate2 (default when --model-dir is given) or fairseq (with --checkpoint)")
    p.add_argument("--checkpoint", help="a fairseq checkpoint (.pt) for --engine fairseq")
    p.add_argument("--nbest", type=int, default=1,
                   help="hypotheses per line, best first (1; at most --beam): N output lines per input line, or "
                        "N translations with --json-lines")
    p.add_argument("--json-lines", action="store_true",
                   help="write one JSON object per input line: its translations with the engine's scores")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch (64)")
    p.add_argument("--flush-after", type=float, default=0.1, metavar="SECONDS",
                   help="input from a pipe or terminal: translate the lines that have come this long after the "
                        "first of them, without waiting for a full batch (0.1)")
    p.add_argument("--input-format", choices=("raw", "bpe"), default="raw",
                   help="raw text (default), or lines already tokenized and BPE'd like bpe/test.SRC")
    p.add_argument("--output-format", choices=OUTPUT_FORMATS,
                   help="detok: Moses-detokenized text (default); tok: tokenized, BPE removed (as "
                        "evaluate.sh's hyp.tok.TGT); bpe: the model's tokens")
    p.add_argument("--too-long", choices=TOO_LONG_POLICIES, default="refuse",
                   help="a line beyond the model's source positions: refuse it, stopping (default); skip it (an "
                        "empty translation); or truncate it to fit. Skipped and truncated lines are counted on stderr")
    p.add_argument("--replace-invalid-utf8", action="store_true",
                   help="replace invalid UTF-8 bytes in the input with U+FFFD instead of stopping")
    p.add_argument("--quiet", action="store_true",
                   help="no progress (a bar on a terminal, else a line every tenth of the way) and no summary")
    p.add_argument("--stats-json", help="write the decoding time and speed here as JSON")
    args = p.parse_args(argv)
    check_model_arguments(p, args, (("batch_size", 1), ("nbest", 1)))
    if args.nbest > args.beam:
        p.error(f"--nbest {args.nbest}: beam search keeps --beam {args.beam} hypotheses; give --nbest at most --beam")
    if not 0 <= args.flush_after < float("inf"):
        p.error(f"--flush-after must be a number of seconds >= 0, not {args.flush_after}")
    args.decoding = Decoding(args.beam, args.lenpen, args.max_len, args.nbest)
    return args


# --- setup: every flag and file checked before any text is read -----------------------------------
def check_setup(args):
    """Resolve defaults and check every file and flag before any text is read: raises UserError."""
    check_model(args)
    check_outputs(args)
    if args.input != "-" and not Path(args.input).is_file() and not is_stream(args.input):
        raise UserError(f"input file {args.input} does not exist" if not Path(args.input).exists()
                        else f"input {args.input} is not a file")
    args.streaming = is_stream(args.input) and args.output is None


def check_model(args):
    """The model, its languages and its segmentation (fairseq-rope-serve's setup too): the engine
    and its files, the bundle verified against its manifest, the work dir and data-bin, the
    languages, the segmentation of raw text, and the vocabularies against the dictionaries.
    Raises UserError."""
    if args.engine is None:
        if args.model_dir:
            args.engine = "ctranslate2"
        elif args.checkpoint:
            args.engine = "fairseq"
        else:
            raise UserError("give --model-dir (a CTranslate2 export) or --engine fairseq --checkpoint CKPT")
    args.bundle = None
    if args.engine == "ctranslate2":
        if not args.model_dir:
            raise UserError("--engine ctranslate2 needs --model-dir (export one with fairseq-rope-export)")
        if not Path(args.model_dir).is_dir():
            raise UserError(f"--model-dir {args.model_dir} is not a directory")
        args.bundle = verified_bundle(args.model_dir)
    else:
        if not args.checkpoint:
            raise UserError("--engine fairseq needs --checkpoint CKPT")
        missing = [name for name in ("torch", "fairseq") if importlib.util.find_spec(name) is None]
        if missing:  # a deployment installs neither (docs/deploy.md)
            raise UserError(f"--engine fairseq needs {' and '.join(missing)}, which this environment lacks: install "
                            "them (docs/usage.md#install), or translate an export with --model-dir")
        if not Path(args.checkpoint).is_file():
            raise UserError(f"--checkpoint {args.checkpoint} is not a file")
        if args.compute_type not in fairseq_engine.COMPUTE_TYPES:
            raise UserError(f"--compute-type {args.compute_type} is for --engine ctranslate2; fairseq takes "
                            f"{', '.join(fairseq_engine.COMPUTE_TYPES)}")
        if args.compute_type in ("float16", "bfloat16") and args.device != "cuda":
            raise UserError(f"--compute-type {args.compute_type} with --engine fairseq needs --device cuda")
    work = Path(args.work_dir) if args.work_dir else None
    if work is not None and not work.is_dir():
        raise UserError(f"--work-dir {work} is not a directory")
    args.work_dir = work
    args.data_bin = Path(args.data_bin) if args.data_bin else (work / "data-bin" if work else None)
    if args.data_bin is not None and not args.data_bin.is_dir():
        raise UserError(f"--data-bin {args.data_bin} is not a directory" if work is None or
                        args.data_bin != work / "data-bin" else
                        f"--work-dir {work} has no data-bin/: run prepare.sh first (or give --data-bin)")
    if args.engine == "fairseq" and args.data_bin is None:
        raise UserError("--engine fairseq needs the model's dictionaries: give --work-dir (or --data-bin)")
    check_languages(args)
    check_segmentation(args)
    if args.engine == "ctranslate2" and args.data_bin is not None:
        check_vocabulary(args)


def verified_bundle(model_dir):
    """The bundle's manifest, every file checked against it, none a link out of it (None: a
    --length-buckets export of a version before bundles, verified by its own manifest); a
    directory without bundle.json is refused, never loaded unverified."""
    try:
        return exported.verified_bundle(model_dir)
    except (OSError, ValueError) as e:
        again = "--length-buckets" if exported.is_bucket_export(model_dir) else ""
        raise UserError(f"--model-dir {model_dir}: {first_line(e)}: export it again with fairseq-rope-export"
                        + (f" {again}" if again else "")) from None


def check_languages(args):
    """--src/--tgt: as the bundle and the data-bin record them (given, they must agree)."""
    recorded = {}
    src, tgt = work_dir.languages_of(args.data_bin)
    if src and tgt:
        recorded[f"the data-bin {args.data_bin}"] = (src, tgt)
    if args.bundle is not None:
        recorded[f"--model-dir {args.model_dir}"] = (args.bundle["source_language"], args.bundle["target_language"])
    for where, (src, tgt) in recorded.items():
        if (args.src or src, args.tgt or tgt) != (src, tgt):  # swapped, one side repeated, another pair
            raise UserError(f"--src {args.src or src} --tgt {args.tgt or tgt}: {where} is for {src}-{tgt} "
                            f"(translating {src} to {tgt}): pass --src {src} --tgt {tgt}, or leave both out")
        args.src, args.tgt = src, tgt


def check_segmentation(args):
    """args.segmentation (raw input), args.bpe_type and args.output_format, from the bundle or the work dir."""
    held = exported.bundle_segmentation(args.model_dir, args.bundle) if args.bundle else None
    tokenized = held.tokenize if held else (args.work_dir is None or work_dir.is_tokenized(args.work_dir))
    if args.output_format is None:
        args.output_format = "detok" if tokenized else "tok"
        if not tokenized:
            say(f"{held.origin if held else args.work_dir} was prepared with --no-tokenize: input is taken as "
                "tokenized and the output is left tokenized (--output-format tok)")
    needs = {"--src": args.src is None and (args.input_format == "raw" or args.engine == "fairseq"),
             "--tgt": args.tgt is None and (args.output_format == "detok" or args.engine == "fairseq")}
    for flag, missing in needs.items():
        if missing:
            where = f"the data-bin {args.data_bin} does not record it" if args.data_bin else "there is no data-bin"
            raise UserError(f"{flag}: cannot tell the language ({where}); pass {flag}")
    if args.data_bin is not None:
        for lang in filter(None, (args.src, args.tgt)):
            if not (args.data_bin / f"dict.{lang}.txt").is_file():
                raise UserError(f"--data-bin {args.data_bin} has no dict.{lang}.txt: wrong --src/--tgt, or not "
                                "the data-bin of this model")
    args.bpe_type = held.bpe_type if held else work_dir.bpe_type_of(args.data_bin, args.work_dir)
    args.segmentation = None
    if args.input_format == "raw":
        if held is None and args.work_dir is None:
            raise UserError("--work-dir is needed to tokenize and BPE raw text: the directory prepare.sh wrote (or "
                            "pass --input-format bpe, or export a bundle with fairseq-rope-export --work-dir)")
        if args.bpe_type is None:
            where = args.data_bin or args.work_dir
            raise UserError(f"cannot tell the BPE kind: {where}/bpe_type is missing")
        given = args.work_dir and work_dir.segmentation_of(args.work_dir, args.src, args.tgt, args.bpe_type)
        if held and given and not exported.bundle_holds(args.bundle, args.src, args.tgt, given):
            raise UserError(f"--work-dir {args.work_dir}: its segmentation (bpe/ and tok/ steps) is not the one "
                            f"--model-dir {args.model_dir} holds: leave --work-dir out (the bundle has its own), or "
                            "give the work dir the model was trained on")
        args.segmentation = held or given
    elif args.bpe_type is None and args.output_format != "bpe":
        where = args.data_bin or args.work_dir
        raise UserError(f"cannot tell the BPE kind: {where}/bpe_type is missing" if where else
                        "cannot tell the BPE kind: give --work-dir or --data-bin (its bpe_type file)")


def recorded_limit(model_dir):
    """The export's length limit, or None with a warning: CTranslate2 itself has no limit for RoPE
    models and would take any length, up to running out of memory."""
    try:
        limit = exported.source_limit(model_dir)
    except (OSError, ValueError) as e:
        raise UserError(f"--model-dir: cannot read the length limit of {model_dir} ({first_line(e)}): export the "
                        "model again") from None
    if limit is None:
        say(f"--model-dir {model_dir}: the export records no max_source_positions (exported by an older "
            "export_ctranslate2.py): no input-length limit is known; export it again, or pass --max-source-positions")
    return limit


def check_outputs(args):
    """Every file this run will write can be written, before hours of decoding: a writable
    directory (a symlink's target is what gets replaced), not a directory, not the same file twice,
    none of the files it reads; without --output, an open standard output."""
    if args.output is None:
        problem = closed_stdout_problem("--output")
        if problem:
            raise UserError(problem)
    outputs = {"--output": args.output, "--stats-json": args.stats_json}
    problem = output_files_problem(outputs, input_files(args))
    if problem:
        raise UserError(problem)
    if args.model_dir is not None:
        # a file added to an export is one its manifest does not list: it would stop loading
        model_dir = Path(os.path.realpath(args.model_dir))
        for flag, path in outputs.items():
            if path is not None and model_dir in Path(os.path.realpath(path)).parents:
                raise UserError(f"{flag} {path} is inside --model-dir {args.model_dir}, which must hold only what "
                                "fairseq-rope-export wrote: write it elsewhere")


def input_files(args) -> dict:
    """Every file this run reads, by what names it (a description, for the message): the input,
    the model's files, the dictionaries and the work dir's step records and BPE files."""
    inputs = {"the input file": None if args.input == "-" else args.input}
    if args.engine == "fairseq":
        inputs["--checkpoint"] = args.checkpoint
    else:
        model_dir = Path(args.model_dir)
        for path in sorted(model_dir.rglob("*")):
            if path.is_file():
                inputs[f"--model-dir's {path.relative_to(model_dir)}"] = path
    if args.data_bin is not None:
        for name in sorted({f"dict.{lang}.txt" for lang in (args.src, args.tgt) if lang} | {"bpe_type", ".done"}):
            inputs[f"--data-bin's {name}"] = args.data_bin / name
    if args.work_dir is not None:
        for name in ("tok/.done", "bpe/.done", "bpe/codes", f"bpe/vocab.{args.src}", "bpe/spm.model"):
            inputs[f"--work-dir's {name}"] = args.work_dir / name
    return inputs


def check_vocabulary(args):
    """The CTranslate2 model was exported with this data-bin's dictionaries, token for token in
    the same order (each bucket of a --length-buckets export is a model of its own: every one)."""
    model_dir = Path(args.model_dir)
    model_dirs = [model_dir]
    if exported.is_bucket_export(model_dir):
        from fairseq_rope_tools.deploy.length_buckets import bucket_manifest

        model_dirs = [model_dir / b["directory"] for b in bucket_manifest(model_dir)["buckets"]]
    for directory in model_dirs:
        for side, lang in (("source", args.src), ("target", args.tgt)):
            if lang is None:
                continue
            try:
                path, vocab = exported.read_vocabulary(directory, side)
            except (OSError, ValueError) as e:
                raise UserError(f"--model-dir {args.model_dir}: {first_line(e)}: export the model again") from None
            problem = vocab and work_dir.vocabulary_problem(vocab, path, args.data_bin / f"dict.{lang}.txt")
            if problem:
                raise UserError(f"--model-dir {args.model_dir} was not exported with the dictionary of "
                                f"{args.data_bin}: {problem}: give the work dir / data-bin the model was trained on")


# --- the run ----------------------------------------------------------------------------------------
@command
def main(argv=None):
    args = parse_args(argv)
    check_setup(args)
    segment = Segmenter(args.segmentation) if args.input_format == "raw" else str.split
    engine = ENGINES[args.engine](args)
    reader = text_tools.LineReader(_Stdin() if args.input == "-" else args.input, args.replace_invalid_utf8,
                                   max_bytes=line_byte_cap(engine.max_source))
    limit = LengthLimit(engine.max_source, args.too_long, reader.path)
    output = OutputFormat(args.output_format, args.nbest, args.json_lines, args.bpe_type, args.tgt)

    def translated(numbered_lines, progress=False):
        """Output lines, input lines, sentences translated and decoding seconds of (number, line)
        pairs, and the refusal of a line too long (None): the lines before it are translated all
        the same."""
        numbers, sources, notes = [], [], []
        refusal = None
        for number, line in numbered_lines:
            try:
                if isinstance(line, OverlongLine):  # never segmented whole
                    source, cut = limit.apply_overlong(number, line, segment), True
                else:
                    tokens = segment(line)
                    source = limit.apply(number, tokens)
                    cut = source is not None and len(source) < len(tokens)
            except UserError as e:
                refusal = e
                break
            numbers.append(number)
            sources.append(source)
            notes.append("skipped" if source is None else "truncated" if cut else None)
        results, seconds = translate_sorted(engine, sources, args.batch_size, progress)
        return output.lines(numbers, results, notes), len(numbers), sum(1 for s in sources if s), seconds, refusal

    if args.output is None:
        sys.stdout.reconfigure(encoding="utf-8")  # UTF-8 whatever the locale, as --output is
    lines = sentences = 0
    seconds = 0.0
    refusal = None
    try:
        if args.streaming:  # each batch written as soon as it is translated
            for batch in batches_as_they_come(reader, args.batch_size, args.flush_after):
                out, n_lines, n_sentences, spent, refusal = translated(batch)
                write_lines(None, out)
                lines, sentences, seconds = lines + n_lines, sentences + n_sentences, seconds + spent
                if refusal:
                    break
        else:  # read whole and sorted by length; up to a refused line
            out, lines, sentences, seconds, refusal = translated(enumerate(reader, 1),
                                                                 progress=not args.quiet and args.input != "-")
            write_lines(args.output, out)
    except BrokenPipeError:
        raise  # the reader has gone (| head): the command ends quietly
    except OSError as e:  # checked before decoding, so only what changed since: a full disk, ...
        raise UserError(f"{f'--output {args.output}' if args.output else 'standard output'}: {e.strerror or e}",
                        status=1) from None
    finally:
        reader.report(say)  # "[translate] ..." lines
        if limit.report():
            say(limit.report())  # never silent, even with --quiet
    if refusal is not None:
        where = f"--output {args.output}" if args.output else "standard output"
        raise UserError(f"{refusal} (the {lines} line{'s' if lines != 1 else ''} before it: translated to {where})"
                        if lines else str(refusal), status=refusal.status)

    stats = dict(engine=args.engine, sentences=sentences, lines=lines, seconds=round(seconds, 3),
                 sentences_per_second=round(sentences / seconds, 2) if seconds > 0 else None, beam=args.beam,
                 lenpen=args.lenpen, nbest=args.nbest, batch_size=args.batch_size, threads=args.threads,
                 device=args.device, compute_type=args.compute_type, too_long=limit.stats(), **engine.report())
    if args.stats_json:
        try:
            write_text_atomically(args.stats_json, json.dumps(stats, indent=1) + "\n")
        except OSError as e:
            raise UserError(f"--stats-json {args.stats_json}: {e.strerror or e}", status=1) from None
    if not args.quiet:
        say(f"{lines} lines ({sentences} to translate) in {seconds:.2f} s of decoding"
            + (f": {stats['sentences_per_second']:.1f} sentences/s" if seconds > 0 else "")
            + f" ({args.engine}, beam {args.beam}, {args.threads} thread{'s' if args.threads != 1 else ''})")
        if engine.summary():
            say(engine.summary())


if __name__ == "__main__":
    main()

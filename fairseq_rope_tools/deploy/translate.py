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
translates its first tokens, ``--too-long split`` translates its sentences (sentencex) and joins
their translations back into one line (a sentence still too long: ``--too-long-sentence``), and
each reports how many lines it affected; ``--max-source-positions`` sets another limit. A line
is read only up to the bytes the limit can hold
(:func:`~fairseq_rope_tools.deploy.batching.line_byte_cap`; 1 MiB to be split): an endless line
costs no memory.

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
import json
import os
import stat
import sys
from pathlib import Path

from fairseq_rope_base.files import output_files_problem, write_lines, write_text_atomically
from fairseq_rope_tools.cli import ArgumentParser, UserError, closed_stdout_problem, command, sayer
from fairseq_rope_tools.deploy import engines
from fairseq_rope_tools.deploy.batching import (
    LengthLimit,
    add_too_long_arguments,
    batches_as_they_come,
    fits,
    line_byte_cap,
    translate_sorted,
)
from fairseq_rope_tools.deploy.engine import Decoding
from fairseq_rope_tools.deploy.model_setup import ModelSetup, add_model_arguments, check_model, check_model_arguments
from fairseq_rope_tools.deploy.output import OutputFormat
from fairseq_rope_tools.deploy.paragraphs import (
    PARAGRAPH_BYTES,
    add_sentences_per_input_argument,
    check_sentences_per_input,
    rejoined,
    sentence_groups,
    sentence_splitter,
)
from fairseq_rope_tools.deploy.segmentation import OUTPUT_FORMATS, Segmenter
from fairseq_rope_tools.text_lines import OverlongLine
from fairseq_rope_tools.text_steps import CommandLineReader

say = sayer("translate")




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


def parse_args(argv):
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", nargs="?", default="-", help="text to translate, one sentence per line (default: stdin)")
    p.add_argument("-o", "--output", help="write the translations here, atomically (default: stdout)")
    add_model_arguments(p, engines.registered_engines())  # --engine, and each engine's flags (--checkpoint)
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
    add_too_long_arguments(p)
    add_sentences_per_input_argument(p, "line")
    p.add_argument("--replace-invalid-utf8", action="store_true",
                   help="replace invalid UTF-8 bytes in the input with U+FFFD instead of stopping")
    p.add_argument("--quiet", action="store_true",
                   help="no progress (a bar on a terminal, else a line every tenth of the way) and no summary")
    p.add_argument("--stats-json", help="write the decoding time and speed here as JSON")
    args = p.parse_args(argv)
    check_model_arguments(p, args, (("batch_size", 1), ("nbest", 1)))
    if args.nbest > args.beam:
        p.error(f"--nbest {args.nbest}: beam search keeps --beam {args.beam} hypotheses; give --nbest at most --beam")
    if args.too_long == "split" and args.input_format != "raw":
        p.error("--too-long split splits raw text into sentences: it needs --input-format raw")
    check_sentences_per_input(p, args)
    if not 0 <= args.flush_after < float("inf"):
        p.error(f"--flush-after must be a number of seconds >= 0, not {args.flush_after}")
    return args


# --- setup: every flag and file checked before any text is read -----------------------------------
def check_setup(args) -> ModelSetup:
    """The model, every file and flag checked before any text is read: raises UserError."""
    setup = check_model(args, args.engine, args.input_format, args.output_format)
    check_outputs(args, setup)
    if args.input != "-" and not Path(args.input).is_file() and not is_stream(args.input):
        raise UserError(f"input file {args.input} does not exist" if not Path(args.input).exists()
                        else f"input {args.input} is not a file")
    return setup


def check_outputs(args, setup: ModelSetup):
    """Every file this run will write can be written, before hours of decoding: a writable
    directory (a symlink's target is what gets replaced), not a directory, not the same file twice,
    none of the files it reads; without --output, an open standard output."""
    if args.output is None:
        problem = closed_stdout_problem("--output")
        if problem:
            raise UserError(problem)
    outputs = {"--output": args.output, "--stats-json": args.stats_json}
    problem = output_files_problem(outputs, input_files(args.input, setup))
    if problem:
        raise UserError(problem)
    if args.model_dir is not None:
        # a file added to an export is one its manifest does not list: it would stop loading
        model_dir = Path(os.path.realpath(args.model_dir))
        for flag, path in outputs.items():
            if path is not None and model_dir in Path(os.path.realpath(path)).parents:
                raise UserError(f"{flag} {path} is inside --model-dir {args.model_dir}, which must hold only what "
                                "fairseq-rope-export wrote: write it elsewhere")


def input_files(input_path: str, setup: ModelSetup) -> dict:
    """Every file this run reads, by what names it (a description, for the message): the input,
    the model's files, the dictionaries and the work dir's step records and BPE files."""
    inputs = {"the input file": None if input_path == "-" else input_path}
    inputs.update(engines.engine_named(setup.engine).files_read(setup))
    if setup.data_bin is not None:
        for name in sorted({f"dict.{lang}.txt" for lang in (setup.src, setup.tgt) if lang} | {"bpe_type", ".done"}):
            inputs[f"--data-bin's {name}"] = setup.data_bin / name
    if setup.work_dir is not None:
        for name in ("tok/.done", "bpe/.done", "bpe/codes", f"bpe/vocab.{setup.src}", "bpe/spm.model"):
            inputs[f"--work-dir's {name}"] = setup.work_dir / name
    return inputs


# --- the run ----------------------------------------------------------------------------------------
@command
def main(argv=None):
    args = parse_args(argv)
    setup = check_setup(args)
    streaming = is_stream(args.input) and args.output is None  # each batch written as soon as it is translated
    segment = Segmenter(setup.segmentation) if setup.input_format == "raw" else str.split
    engine = engines.open_engine(setup, args, Decoding(args.beam, args.lenpen, args.max_len, args.nbest), streaming)
    split = sentence_splitter(setup.src) if args.too_long == "split" else None
    cap = line_byte_cap(engine.max_source)
    reader = CommandLineReader(_Stdin() if args.input == "-" else args.input, args.replace_invalid_utf8,
                               max_bytes=max(cap, PARAGRAPH_BYTES) if split and cap else cap)
    # with --too-long split, the limit applies to each sentence of a split line (and to a line over the cap)
    limit = LengthLimit(engine.max_source, args.too_long_sentence if split else args.too_long, reader.path,
                        split=split is not None)
    split_lines = []  # the numbers of the lines split
    output = OutputFormat(setup.output_format, args.nbest, args.json_lines, setup.bpe_type, setup.tgt)

    per_input = args.max_sentences_per_input

    def grouped_sources(number, sentences):
        """The sources of a line split into ``sentences``: --max-sentences-per-input of them at a
        time (else one), a group that does not fit as its sentences one by one."""
        return [limit.apply(number, segment(text) if tokens is None else tokens)
                for _, text, tokens in sentence_groups(sentences, per_input or 1, segment, limit.limit)]

    def translated(numbered_lines, progress=False):
        """Output lines, input lines, sentences translated and decoding seconds of (number, line)
        pairs, and the refusal of a line too long (None): the lines before it are translated all
        the same."""
        numbers, sources, notes = [], [], []
        pieces = []  # per line, its sources' positions in ``sources``
        refusal = None
        for number, line in numbered_lines:
            try:
                if isinstance(line, OverlongLine):  # never segmented whole
                    source = limit.apply_overlong(number, line, segment)
                    line_sources, note = [source], "skipped" if source is None else "truncated"
                else:
                    tokens = segment(line)
                    sentences = split(line) if split is not None and (per_input or not fits(tokens, limit.limit)) \
                        else None
                    if sentences is not None and (not fits(tokens, limit.limit) or len(sentences) > per_input):
                        line_sources, note = grouped_sources(number, sentences), "split"
                        split_lines.append(number)
                    else:
                        source = limit.apply(number, tokens)
                        line_sources = [source]
                        note = "skipped" if source is None else "truncated" if len(source) < len(tokens) else None
            except UserError as e:
                refusal = e
                break
            numbers.append(number)
            pieces.append(range(len(sources), len(sources) + len(line_sources)))
            sources += line_sources
            notes.append(note)
        results, seconds = translate_sorted(engine, sources, args.batch_size, progress)
        out = output.lines(numbers, rejoined(results, pieces, args.nbest), notes)
        return out, len(numbers), sum(1 for s in sources if s), seconds, refusal

    if args.output is None:
        sys.stdout.reconfigure(encoding="utf-8")  # UTF-8 whatever the locale, as --output is
    lines = sentences = 0
    seconds = 0.0
    refusal = None
    try:
        if streaming:
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
        if split_lines:  # never silent, even with --quiet
            why = f"longer than the model takes ({limit.limit - 1} BPE tokens)" if limit.limit else ""
            if per_input:
                why += f"{' or ' if why else ''}of more than {per_input} sentence{'s' if per_input != 1 else ''}"
            say(f"{reader.path}: {len(split_lines)} line{'s' if len(split_lines) != 1 else ''} {why} split into "
                f"sentences (first: line {split_lines[0]})")
        if limit.report():
            say(limit.report())
    if refusal is not None:
        where = f"--output {args.output}" if args.output else "standard output"
        raise UserError(f"{refusal} (the {lines} line{'s' if lines != 1 else ''} before it: translated to {where})"
                        if lines else str(refusal), status=refusal.status)

    too_long = dict(limit.stats(), split_lines=len(split_lines))
    if split:  # the limit's policy is then the one for a sentence still too long
        too_long.update(policy="split", sentence_policy=too_long["policy"])
    stats = dict(engine=setup.engine, sentences=sentences, lines=lines, seconds=round(seconds, 3),
                 sentences_per_second=round(sentences / seconds, 2) if seconds > 0 else None, beam=args.beam,
                 lenpen=args.lenpen, nbest=args.nbest, batch_size=args.batch_size, threads=args.threads,
                 device=args.device, compute_type=args.compute_type, too_long=too_long, **engine.report())
    if args.stats_json:
        try:
            write_text_atomically(args.stats_json, json.dumps(stats, indent=1) + "\n")
        except OSError as e:
            raise UserError(f"--stats-json {args.stats_json}: {e.strerror or e}", status=1) from None
    if not args.quiet:
        say(f"{lines} lines ({sentences} to translate) in {seconds:.2f} s of decoding"
            + (f": {stats['sentences_per_second']:.1f} sentences/s" if seconds > 0 else "")
            + f" ({setup.engine}, beam {args.beam}, {args.threads} thread{'s' if args.threads != 1 else ''})")
        if engine.summary():
            say(engine.summary())


if __name__ == "__main__":
    main()

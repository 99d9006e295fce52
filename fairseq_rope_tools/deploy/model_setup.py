"""The model a translation runs, as fairseq-rope-translate and fairseq-rope-serve both set it up:
the flags that choose it, its segmentation and its beam search; every file and flag checked (the
bundle against its manifest, the work dir and data-bin, the languages, the segmentation of raw
text, the vocabularies against the dictionaries) before any text is read, each engine's own
checks as its entry in the registry of engines (engines.py) says."""

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from fairseq_rope_tools.cli import UserError, sayer
from fairseq_rope_tools.deploy import engines, exported, work_dir
from fairseq_rope_tools.deploy.segmentation import Segmentation, first_line

say = sayer("translate")  # the messages of the setup are fairseq-rope-translate's, in serve too


@dataclass(frozen=True)
class ModelSetup:
    """The model :func:`check_model` found, every file and flag checked: the engine and its files,
    the languages, and the text steps around the model. The paths of the model are as given."""

    engine: str                                  # the name of a registered engine (engines.py)
    output_format: str                           # one of segmentation.OUTPUT_FORMATS
    input_format: str = "raw"                    # raw text, or the model's tokens ("bpe")
    model_dir: Optional[str] = None              # what a bundle engine (--engine ctranslate2) loads
    checkpoint: Optional[str] = None             # what --engine fairseq loads
    bundle: Optional[dict] = None                # the verified manifest of --model-dir (None: no bundle)
    work_dir: Optional[Path] = None
    data_bin: Optional[Path] = None
    src: Optional[str] = None
    tgt: Optional[str] = None
    bpe_type: Optional[str] = None
    segmentation: Optional[Segmentation] = None  # of raw input (None: tokens are taken as they come)


def default_threads():
    """$OMP_NUM_THREADS, else 1: one thread is never slowed down by other work on the host, where
    threads that wait for each other are (docs/deploy.md, "Threads on a shared host")."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else 1


def add_model_arguments(p, offered_engines):
    """The flags that choose the model, its segmentation and its beam search, which
    fairseq-rope-serve shares: the same bundle and flags give the same translations; --engine, one
    of ``offered_engines`` (entries of engines.py), and their own flags."""
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
                   help="CPU threads (default: $OMP_NUM_THREADS, else 1, which a busy host never slows down; "
                        "more are faster on an idle one: docs/deploy.md)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--compute-type", default="default",
                   help="CTranslate2: default (the type the model was exported with: float32 unless exported "
                        "with --quantization), float32, int8, int8_float32, float16, bfloat16, ...; "
                        "fairseq: float32, or float16 / bfloat16 on cuda")
    p.add_argument("--max-source-positions", type=int,
                   help="the longest source the model takes, in BPE tokens plus the </s> appended to each "
                        "(default: the model's max_source_positions: from the checkpoint, or recorded by "
                        "fairseq-rope-export)")
    engines.add_engine_arguments(p, offered_engines)


def check_model_arguments(p, args, minimums=()):
    """argparse's refusal of the values of :func:`add_model_arguments`' flags (and of ``minimums``,
    (flag, least value) pairs of the command's own) that no model takes."""
    for flag, minimum in (("beam", 1), ("max_len", 1), ("threads", 1), ("max_source_positions", 2), *minimums):
        if getattr(args, flag) is not None and getattr(args, flag) < minimum:
            p.error(f"--{flag.replace('_', '-')} must be at least {minimum}, not {getattr(args, flag)}")
    if args.lenpen != args.lenpen:  # NaN
        p.error("--lenpen must be a number")


def check_model(args, engine: Optional[str] = None, input_format: str = "raw",
                output_format: Optional[str] = None) -> ModelSetup:
    """The model, its languages and its segmentation, from the flags of :func:`add_model_arguments`
    in ``args`` and the command's own (fairseq-rope-serve's: a bundle, raw text): the engine
    (``engine``, else :func:`engines.default_engine`'s) and its files as it checks them (the bundle
    verified against its manifest, the checkpoint), the work dir and data-bin, the languages, the
    segmentation of raw text, and the vocabularies against the dictionaries. Raises UserError."""
    entry = engines.engine_named(engine) if engine else engines.default_engine(args)
    found = entry.check(args)
    work = Path(args.work_dir) if args.work_dir else None
    if work is not None and not work.is_dir():
        raise UserError(f"--work-dir {work} is not a directory")
    data_bin = Path(args.data_bin) if args.data_bin else (work / "data-bin" if work else None)
    if data_bin is not None and not data_bin.is_dir():
        raise UserError(f"--data-bin {data_bin} is not a directory" if work is None or data_bin != work / "data-bin"
                        else f"--work-dir {work} has no data-bin/: run prepare.sh first (or give --data-bin)")
    if entry.needs_data_bin and data_bin is None:
        raise UserError(f"--engine {entry.name} needs the model's dictionaries: give --work-dir (or --data-bin)")
    src, tgt = check_languages(args.src, args.tgt, data_bin, args.model_dir, found.bundle)
    setup = ModelSetup(entry.name, output_format, input_format, args.model_dir, found.checkpoint, found.bundle, work,
                       data_bin, src, tgt)
    setup = check_segmentation(setup)
    if entry.checks_vocabulary and data_bin is not None:
        check_vocabulary(setup)
    return setup


def check_languages(src: Optional[str], tgt: Optional[str], data_bin: Optional[Path], model_dir,
                    bundle: Optional[dict]) -> Tuple[Optional[str], Optional[str]]:
    """--src/--tgt (``src``, ``tgt``: as given): as the bundle and the data-bin record them (given,
    they must agree)."""
    recorded = {}
    data_src, data_tgt = work_dir.languages_of(data_bin)
    if data_src and data_tgt:
        recorded[f"the data-bin {data_bin}"] = (data_src, data_tgt)
    if bundle is not None:
        recorded[f"--model-dir {model_dir}"] = (bundle["source_language"], bundle["target_language"])
    for where, (recorded_src, recorded_tgt) in recorded.items():
        if (src or recorded_src, tgt or recorded_tgt) != (recorded_src, recorded_tgt):  # swapped, another pair
            raise UserError(f"--src {src or recorded_src} --tgt {tgt or recorded_tgt}: {where} is for "
                            f"{recorded_src}-{recorded_tgt} (translating {recorded_src} to {recorded_tgt}): pass "
                            f"--src {recorded_src} --tgt {recorded_tgt}, or leave both out")
        src, tgt = recorded_src, recorded_tgt
    return src, tgt


def check_segmentation(setup: ModelSetup) -> ModelSetup:
    """``setup`` with its segmentation (raw input), BPE kind and output format (when not given),
    from the bundle or the work dir."""
    held = exported.bundle_segmentation(setup.model_dir, setup.bundle) if setup.bundle else None
    tokenized = held.tokenize if held else (setup.work_dir is None or work_dir.is_tokenized(setup.work_dir))
    output_format = setup.output_format
    if output_format is None:
        output_format = "detok" if tokenized else "tok"
        if not tokenized:
            say(f"{held.origin if held else setup.work_dir} was prepared with --no-tokenize: input is taken as "
                "tokenized and the output is left tokenized (--output-format tok)")
    src, tgt, data_bin = setup.src, setup.tgt, setup.data_bin
    both = engines.engine_named(setup.engine).needs_data_bin  # it decodes with both languages' dictionaries
    needs = {"--src": src is None and (setup.input_format == "raw" or both),
             "--tgt": tgt is None and (output_format == "detok" or both)}
    for flag, missing in needs.items():
        if missing:
            where = f"the data-bin {data_bin} does not record it" if data_bin else "there is no data-bin"
            raise UserError(f"{flag}: cannot tell the language ({where}); pass {flag}")
    if data_bin is not None:
        for lang in filter(None, (src, tgt)):
            if not (data_bin / f"dict.{lang}.txt").is_file():
                raise UserError(f"--data-bin {data_bin} has no dict.{lang}.txt: wrong --src/--tgt, or not "
                                "the data-bin of this model")
    bpe_type = held.bpe_type if held else work_dir.bpe_type_of(data_bin, setup.work_dir)
    segmentation = None
    if setup.input_format == "raw":
        if held is None and setup.work_dir is None:
            raise UserError("--work-dir is needed to tokenize and BPE raw text: the directory prepare.sh wrote (or "
                            "pass --input-format bpe, or export a bundle with fairseq-rope-export --work-dir)")
        if bpe_type is None:
            where = data_bin or setup.work_dir
            raise UserError(f"cannot tell the BPE kind: {where}/bpe_type is missing")
        given = setup.work_dir and work_dir.segmentation_of(setup.work_dir, src, tgt, bpe_type)
        if held and given and not exported.bundle_holds(setup.bundle, src, tgt, given):
            raise UserError(f"--work-dir {setup.work_dir}: its segmentation (bpe/ and tok/ steps) is not the one "
                            f"--model-dir {setup.model_dir} holds: leave --work-dir out (the bundle has its own), or "
                            "give the work dir the model was trained on")
        segmentation = held or given
    elif bpe_type is None and output_format != "bpe":
        where = data_bin or setup.work_dir
        raise UserError(f"cannot tell the BPE kind: {where}/bpe_type is missing" if where else
                        "cannot tell the BPE kind: give --work-dir or --data-bin (its bpe_type file)")
    return dataclasses.replace(setup, output_format=output_format, bpe_type=bpe_type, segmentation=segmentation)


def check_vocabulary(setup: ModelSetup) -> None:
    """The exported model (of an engine that checks_vocabulary, engines.py) was exported with this
    data-bin's dictionaries, token for token in the same order (each bucket of a --length-buckets
    export is a model of its own: every one)."""
    model_dir = Path(setup.model_dir)
    model_dirs = [model_dir]
    if exported.is_bucket_export(model_dir):
        from fairseq_rope_tools.deploy.length_buckets import bucket_manifest

        model_dirs = [model_dir / b["directory"] for b in bucket_manifest(model_dir)["buckets"]]
    for directory in model_dirs:
        for side, lang in (("source", setup.src), ("target", setup.tgt)):
            if lang is None:
                continue
            try:
                path, vocab = exported.read_vocabulary(directory, side)
            except (OSError, ValueError) as e:
                raise UserError(f"--model-dir {setup.model_dir}: {first_line(e)}: export the model again") from None
            problem = vocab and work_dir.vocabulary_problem(vocab, path, setup.data_bin / f"dict.{lang}.txt")
            if problem:
                raise UserError(f"--model-dir {setup.model_dir} was not exported with the dictionary of "
                                f"{setup.data_bin}: {problem}: give the work dir / data-bin the model was trained on")


def check_served_model(args) -> ModelSetup:
    """The model and its segmentation as fairseq-rope-serve takes them: as fairseq-rope-translate
    checks them for raw text from a file (:func:`check_model`), a bundle verified against its
    manifest, the languages, the vocabularies; its engine one that serves (--engine's choices, and
    every default for a bundle). Raises UserError."""
    if not args.model_dir:
        raise UserError("give --model-dir: a bundle written by fairseq-rope-export")
    return check_model(args, engine=args.engine, input_format="raw")

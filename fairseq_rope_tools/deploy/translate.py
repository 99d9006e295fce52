#!/usr/bin/env python3
"""Translate raw text with a trained model, through CTranslate2 or fairseq.

    fairseq-rope-translate --work-dir work/wmt14_en_de --model-dir ct2/wmt14_en_de input.en \\
        --output output.de                                   # an exported CTranslate2 directory
    fairseq-rope-translate --work-dir work/wmt14_en_de --engine fairseq \\
        --checkpoint work/wmt14_en_de/checkpoints/transformer_rope_wmt_en_de/checkpoint.avg5.pt < input.en

Each input line goes through the recipe's own steps (examples/wmt14_en_de/prepare.sh), read from
the prepared work directory ``--work-dir``: Moses punctuation normalisation, removal of
non-printing characters and Moses tokenisation ``-a`` (fairseq_rope_tools.data.text_tools' tokenize; skipped when the
work dir was prepared with --no-tokenize), then the BPE of ``bpe/`` (subword-nmt ``bpe/codes``
with ``bpe/vocab.SRC`` and the recorded vocabulary threshold, or sentencepiece ``bpe/spm.model``).
It is translated with beam search (beam 4, length penalty 0.6, at most 200 tokens, as
fairseq-generate in evaluate.sh), the BPE is removed as fairseq-generate's ``--remove-bpe`` does and
the result is Moses-detokenized. One output line per input line, in input order; an empty line
gives an empty line. Sentences are sorted by length into batches for speed.

Input is read strictly (fairseq_rope_tools/text_lines.py): lines end only at ``\\n`` (CRLF is a plain end; a
``\\r`` or other line-break character inside a line becomes a space, reported), and the first
invalid UTF-8 byte stops the script with the file and line unless ``--replace-invalid-utf8``.
``--output`` is written atomically (a temporary file renamed when complete); without it the
translations go to stdout.

Both engines refuse a line longer than the model's source positions (its BPE tokens and the
``</s>`` appended, as fairseq counts them: ``max_source_positions`` of the checkpoint, or as the
export recorded it in ``export_info.json``); ``--max-source-positions`` sets another limit. Before
anything is decoded, the CTranslate2 model's vocabularies must be the data-bin's dictionaries
token for token in order, ``--src``/``--tgt`` the data-bin's direction, every output path
writable (a symlinked ``--output`` keeps the link; its target is replaced) and none of the files
the run reads, and standard output open when the translations go there.

A ``--model-dir`` written by ``fairseq-rope-export --length-buckets`` (a ``length_buckets.json``
beside one export per bucket) decodes as ``--rope-scaling dynamic-yarn`` scales: each sentence goes
to the model of its length (plain RoPE within the training length L, static YaRN at the next
factor up from its tokens / L beyond), one bucket's model loaded at a time; the sentences each
bucket got are reported. The manifest is verified, not trusted: every bucket's own
``export_info.json`` must record its checkpoint's sha256, factor and L as the manifest lists them,
and its vocabularies are checked as a single export's are.

``--input-format bpe`` takes lines already tokenized and BPE'd (as ``bpe/test.SRC``) and
``--output-format tok`` writes Moses-tokenized hypotheses with the BPE removed (as ``hyp.tok.TGT``
of evaluate.sh): examples/wmt14_en_de/evaluate.sh decodes the test set this way with ENGINE=ctranslate2.
"""

import argparse
import contextlib
import itertools
import json
import os
import sys
import time
import zipfile
from pathlib import Path

from fairseq_rope_tools.cli import (
    ArgumentParser,
    UserError,
    closed_stdout_problem,
    command,
    plugin_dir,
    progress_sayer,
    sayer,
)
from fairseq_rope_tools.data import text_tools  # (the recipe's tokenizer, step records and strict line reader)
from fairseq_rope_tools.deploy.exported import (
    EXPORT_INFO,
    LENGTH_BUCKETS,
    bucket_of,
    read_vocabulary,
    verified_bucket_manifest,
)
from fairseq_rope_tools.files import output_files_problem, write_lines, write_text_atomically

text_tools.PREFIX = "translate"  # its messages read "[translate] ..."

ENGINES = ("ctranslate2", "fairseq")
FAIRSEQ_COMPUTE_TYPES = ("default", "float32", "float16", "bfloat16")
BPE_TYPES = ("subword_nmt", "sentencepiece")


say = sayer("translate")


def first_line(error, limit=200):
    """An exception's message, shortened to fit in a one-line refusal."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return text if len(text) <= limit else text[:limit] + "..."


def read_json(path, flag, default):
    """The JSON in ``path``, or ``default`` when there is no such file."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as e:
        raise UserError(f"{flag}: cannot read {path} ({first_line(e)}): export the model again") from None


# --- the prepared work directory ------------------------------------------------------------
def step_options(directory, name):
    """The options prepare.sh recorded for step ``name`` (``DIR/.done``), or None without a record."""
    marker = Path(directory) / ".done"
    if not marker.is_file():
        return None
    parsed = text_tools._parse_record(marker.read_text(encoding="utf-8", errors="replace"))
    if parsed is None:
        raise UserError(f"{marker} does not record the options of the {name} step (written by an older "
                        "prepare.sh): rerun prepare.sh")
    return parsed[0]


def dict_tokens(path):
    """The tokens of a fairseq dict.L.txt in order, read as fairseq's Dictionary.add_from_file
    reads them ("token count [#fairseq:overwrite]" per line, universal newlines)."""
    tokens = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                word, _, count = line.rstrip().rpartition(" ")
                if count == "#fairseq:overwrite":
                    word, _, count = word.rpartition(" ")
                if not count.isdigit():
                    raise ValueError(f"line {number} is not 'token count'")
                tokens.append(word)
    except (UnicodeDecodeError, ValueError) as e:
        raise UserError(f"--data-bin: {path} is not a fairseq dictionary ({first_line(e)}): rerun prepare.sh") from None
    return tokens


def languages_of(data_bin):
    """(src, tgt) as prepare.sh recorded them in data-bin/.done, else from fairseq-preprocess's
    file names (SPLIT.SRC-TGT.L.idx), else (None, None)."""
    if data_bin is None or not data_bin.is_dir():
        return None, None
    options = step_options(data_bin, "data-bin") or {}
    if options.get("SRC") and options.get("TGT"):
        return options["SRC"], options["TGT"]
    pairs = set()
    for idx in data_bin.glob("*.idx"):
        parts = idx.name.split(".")  # train . en-de . en . idx
        if len(parts) >= 4 and "-" in parts[-3]:
            pairs.add(tuple(parts[-3].split("-", 1)))
    return pairs.pop() if len(pairs) == 1 else (None, None)


def remove_bpe(line, bpe_type):
    """fairseq's --remove-bpe (fairseq.data.data_utils.post_process) for the recipe's two BPE kinds;
    kept here so that the CTranslate2 path needs no fairseq (tests/test_translate.py checks both
    agree)."""
    if bpe_type == "sentencepiece":
        return line.replace(" ", "").replace("\u2581", " ").strip()
    return (line + " ").replace("@@ ", "").rstrip()


@contextlib.contextmanager
def unreadable_as_refused(work_dir, path, kind):
    """A BPE file that its library cannot read (binary, truncated, another format) is refused by name."""
    try:
        yield
    except (UnicodeDecodeError, ValueError, IndexError, RuntimeError, OSError) as e:
        raise UserError(f"--work-dir {work_dir}: {path} is not {kind} ({first_line(e)}): rerun prepare.sh, or give "
                        "the work dir the model was trained on") from None


class Segmenter:
    """raw line -> the source tokens the model was trained on, as prepare.sh made them."""

    def __init__(self, work_dir, src, bpe_type):
        self.tokenize = (step_options(work_dir / "tok", "tok") or {}).get("TOKENIZE", "1") != "0"
        self.bpe_type = bpe_type
        bpe_dir = work_dir / "bpe"
        if bpe_type == "subword_nmt":
            codes, vocab = bpe_dir / "codes", bpe_dir / f"vocab.{src}"
            for path in (codes, vocab):
                if not path.is_file():
                    raise UserError(f"--work-dir {work_dir}: no {path} (subword-nmt BPE): is it the directory "
                                    f"prepare.sh wrote for this model, and --src {src} right?")
            threshold = (step_options(bpe_dir, "bpe") or {}).get("BPE_VOCAB_THRESHOLD", "50")
            from subword_nmt.apply_bpe import BPE, read_vocabulary

            with unreadable_as_refused(work_dir, vocab, "a subword-nmt vocabulary"), open(vocab, encoding="utf-8") as v:
                vocabulary = read_vocabulary(v, int(threshold))
            with unreadable_as_refused(work_dir, codes, "subword-nmt BPE codes"), open(codes, encoding="utf-8") as c:
                self.bpe = BPE(c, vocab=vocabulary)  # as `subword-nmt apply-bpe -c --vocabulary ...`
        else:
            model = bpe_dir / "spm.model"
            if not model.is_file():
                raise UserError(f"--work-dir {work_dir}: no {model} (sentencepiece BPE)")
            import sentencepiece

            with unreadable_as_refused(work_dir, model, "a sentencepiece model"):
                self.spm = sentencepiece.SentencePieceProcessor(model_file=str(model))
        if self.tokenize:
            text_tools._init_tokenizer(src)

    def __call__(self, line):
        line = text_tools.tokenize_line(line) if self.tokenize else " ".join(line.split())
        if not line:
            return []
        if self.bpe_type == "subword_nmt":
            return self.bpe.process_line(line).split()
        return self.spm.encode(line, out_type=str)


# --- engines ----------------------------------------------------------------------------------
# CTranslate2's Linux wheels load cuBLAS at run time, from the CUDA major version they were built
# with (4.x: CUDA 12, "Library libcublas.so.12 is not found" at the first translation without it).
# A machine with only CUDA 13 (torch 2.11+cu130, say) has none: an H200 with that image showed it.
CTRANSLATE2_CUDA_MAJOR = {4: 12}


def ctranslate2_cuda_problem():
    """Why CTranslate2 cannot translate on CUDA here, as one line, or None."""
    import ctypes

    import ctranslate2

    if ctranslate2.get_cuda_device_count() == 0:
        return "CTranslate2 sees no CUDA device"
    cuda = CTRANSLATE2_CUDA_MAJOR.get(int(ctranslate2.__version__.split(".")[0]))
    if cuda is not None:
        try:
            ctypes.CDLL(f"libcublas.so.{cuda}")
        except OSError:
            return (f"CTranslate2 {ctranslate2.__version__} needs CUDA {cuda}'s cuBLAS (libcublas.so.{cuda}), which "
                    f"this machine cannot load: pip install nvidia-cublas-cu{cuda} and put its nvidia/cublas/lib "
                    "directory on LD_LIBRARY_PATH")
    return None


class CTranslate2Engine:
    name = "ctranslate2"

    def __init__(self, args, model_dir=None):
        try:
            import ctranslate2
        except ImportError:
            raise UserError("--engine ctranslate2: the ctranslate2 package is not installed "
                            "(run 'make setup')") from None
        model_dir = Path(model_dir or args.model_dir)
        if not (model_dir / "model.bin").is_file() or not (model_dir / "config.json").is_file():
            raise UserError(f"--model-dir {model_dir} is not a CTranslate2 model directory (no model.bin and "
                            "config.json): export one with fairseq-rope-export")
        problem = ctranslate2_cuda_problem() if args.device == "cuda" else None
        if problem:
            raise UserError(f"--device cuda: {problem}")
        supported = ctranslate2.get_supported_compute_types(args.device) | {"default", "auto"}
        if args.compute_type not in supported:
            raise UserError(f"--compute-type {args.compute_type} is not supported by CTranslate2 on {args.device} "
                            f"(supported: {', '.join(sorted(supported))})")
        self.max_source = args.max_source_positions or self.recorded_max_source(model_dir)
        self.options = dict(beam_size=args.beam, length_penalty=args.lenpen, max_decoding_length=args.max_len,
                            max_input_length=0)  # no silent truncation: main refuses what is too long
        try:
            self.translator = ctranslate2.Translator(str(model_dir), device=args.device,
                                                     compute_type=args.compute_type, intra_threads=args.threads,
                                                     inter_threads=1)
        except (RuntimeError, ValueError) as e:
            raise UserError(f"--model-dir {model_dir}: CTranslate2 cannot load {model_dir / 'model.bin'} "
                            f"({first_line(e)}): export it again with fairseq-rope-export") from None

    @staticmethod
    def recorded_max_source(model_dir):
        """The model's max_source_positions as the export recorded it (export_info.json, else
        config.json), or None with a warning: CTranslate2 itself has no limit for RoPE models and
        would take any length, up to running out of memory."""
        for name in (EXPORT_INFO, "config.json"):
            recorded = read_json(Path(model_dir) / name, "--model-dir", {})
            limit = recorded.get("max_source_positions") if isinstance(recorded, dict) else None
            if isinstance(limit, int) and limit > 1:
                return limit
        say(f"--model-dir {model_dir}: the export records no max_source_positions (exported by an older "
            "export_ctranslate2.py): no input-length limit is known; export it again, or pass --max-source-positions")
        return None

    def translate(self, batch):
        return [r.hypotheses[0] for r in self.translator.translate_batch(batch, **self.options)]


def bucket_manifest(directory):
    """The manifest of the --length-buckets export ``directory``, every bucket checked against it
    (:func:`~fairseq_rope_tools.deploy.exported.verified_bucket_manifest`): a bucket swapped,
    edited or replaced by another export would translate with the wrong model without a word."""
    try:
        return verified_bucket_manifest(directory)
    except (OSError, ValueError) as e:
        raise UserError(f"--model-dir {directory}: {first_line(e)}: export it again with fairseq-rope-export "
                        "--length-buckets") from None


class LengthBuckets:
    """A --length-buckets export (fairseq-rope-export): each sentence is translated by the model of
    its length (:func:`~fairseq_rope_tools.deploy.exported.bucket_of`), as dynamic-yarn would scale
    it. One bucket's model is loaded at a time, so memory holds one copy of the weights."""

    name = "ctranslate2"

    def __init__(self, args):
        directory = Path(args.model_dir)
        manifest = bucket_manifest(directory)
        self.args, self.training_length = args, manifest["training_length"]
        self.factors = [float(b["factor"]) for b in manifest["buckets"]]
        self.labels = ["plain" if f == 1.0 else f"yarn x{f:g}" for f in self.factors]
        self.directories = [directory / b["directory"] for b in manifest["buckets"]]
        limit = manifest.get("max_source_positions")
        self.max_source = args.max_source_positions or (limit if isinstance(limit, int) and limit > 1 else None)
        self.sentences = dict.fromkeys(self.labels, 0)
        # loaded now to refuse a bad device or compute type before any text is read; kept for its bucket
        self.loaded = {0: CTranslate2Engine(args, self.directories[0])}

    def bucket(self, source):
        return bucket_of(len(source), self.training_length, self.factors)

    def translate_all(self, sources, batch_size, progress=False):
        """:func:`translate` of every bucket's sentences with its model, in input order."""
        by_bucket = {}
        for i, source in enumerate(sources):
            if source:
                by_bucket.setdefault(self.bucket(source), []).append(i)
        hyps, seconds = [[] for _ in sources], 0.0
        for index, ids in sorted(by_bucket.items()):
            self.sentences[self.labels[index]] = len(ids)
            engine = self.loaded.pop(index, None)
            self.loaded.clear()  # one model in memory at a time
            engine = engine or CTranslate2Engine(self.args, self.directories[index])
            out, spent = translate(engine, [sources[i] for i in ids], batch_size, progress)
            del engine  # its weights are freed before the next bucket's are loaded
            seconds += spent
            for i, h in zip(ids, out):
                hyps[i] = h
        return hyps, seconds

    def report(self) -> str:
        return f"length buckets (L = {self.training_length} tokens): " + ", ".join(
            f"{label} {n}" for label, n in self.sentences.items())


def torch_file_problem(path):
    """Why ``path`` cannot be a file of torch.save (its zip format, or the legacy pickle one), or
    None: torch's own errors for such files speak of weights_only and miniz."""
    if os.path.getsize(path) == 0:
        return "an empty file"
    with open(path, "rb") as f:
        legacy = f.read(2) == b"\x80\x02"
    if not legacy and not zipfile.is_zipfile(path):
        return "not a file written by torch.save, or a truncated one"
    return None


class FairseqEngine:
    name = "fairseq"

    def __init__(self, args):
        import logging
        import warnings

        logging.getLogger("fairseq").setLevel(logging.WARNING)  # no INFO lines about loading
        warnings.filterwarnings("ignore", message=".*pin_memory.*")  # the data loader's, on a CPU
        import torch

        checkpoint = Path(args.checkpoint).resolve()
        torch.set_num_threads(args.threads)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise UserError("--device cuda: torch sees no CUDA device")
        from omegaconf import open_dict

        hub = self.load(checkpoint, args)
        hub.eval()
        if args.device == "cuda":
            hub.cuda()
        if args.compute_type == "float16":
            hub.half()
        elif args.compute_type == "bfloat16":
            hub.bfloat16()
        with open_dict(hub.cfg):
            hub.cfg.dataset.max_tokens = None  # our batches are the batches: no re-splitting by tokens
        self.hub, self.torch, self.open_dict = hub, torch, open_dict
        self.max_source = self.source_limit(hub, args.max_source_positions)
        # fairseq-generate's defaults for everything evaluate.sh does not set
        self.options = dict(beam=args.beam, lenpen=args.lenpen, max_len_a=0, max_len_b=args.max_len, min_len=1,
                            nbest=1, unkpen=0, sampling=False, no_repeat_ngram_size=0, match_source_len=False)

    @staticmethod
    def load(checkpoint, args):
        """fairseq's hub interface for ``checkpoint`` with the dictionaries of ``args.data_bin``, as
        TransformerModel.from_pretrained builds it, in two steps so that a failure names its cause:
        the file is no checkpoint, or it does not fit the data-bin."""
        from argparse import Namespace

        from fairseq import checkpoint_utils, utils
        from fairseq.hub_utils import GeneratorHubInterface

        overrides = dict(data=str(args.data_bin.resolve()), user_dir=plugin_dir(),
                         source_lang=args.src, target_lang=args.tgt)
        utils.import_user_module(Namespace(user_dir=overrides["user_dir"]))
        try:
            problem = torch_file_problem(checkpoint)
            if problem:
                raise ValueError(problem)
            state = checkpoint_utils.load_checkpoint_to_cpu(str(checkpoint), overrides)
            if state.get("cfg") is None and state.get("args") is None:
                raise KeyError("it holds no model configuration")
        except Exception as e:  # torch, pickle and zip errors, or a file of another kind: all mean the same
            raise UserError(f"--checkpoint {args.checkpoint} is not a readable fairseq checkpoint ({first_line(e)}): "
                            "give a checkpoint written by fairseq-train") from None
        try:
            models, cfg, task = checkpoint_utils.load_model_ensemble_and_task(
                [str(checkpoint)], arg_overrides=overrides, state=state)
        except (RuntimeError, KeyError, ValueError) as e:
            mismatch = [line.strip() for line in str(e).splitlines() if "size mismatch" in line]
            raise UserError(f"--checkpoint {args.checkpoint} does not fit the dictionaries of --data-bin "
                            f"{args.data_bin} ({mismatch[0] if mismatch else first_line(e)}): give the work dir / "
                            "data-bin the model was trained on") from None
        return GeneratorHubInterface(cfg, task, models)

    @staticmethod
    def source_limit(hub, requested):
        """The longest source in positions: the model's, or ``requested`` (--max-source-positions)
        where the model can take it (rotary and sinusoidal positions extend, learned ones do not)."""
        limits = hub.max_positions if isinstance(hub.max_positions, tuple) else (hub.max_positions, None)
        if requested is None:
            return limits[0]
        from fairseq.modules import LearnedPositionalEmbedding

        learned = isinstance(getattr(hub.models[0].encoder, "embed_positions", None), LearnedPositionalEmbedding)
        if learned and requested > limits[0]:
            raise UserError(f"--max-source-positions {requested}: the model has learned positions for at most "
                            f"{limits[0]} source tokens")
        hub.max_positions = (requested, *limits[1:])  # the limit fairseq's batching checks sources against
        return requested

    def translate(self, batch):
        with self.open_dict(self.hub.cfg):
            self.hub.cfg.dataset.batch_size = len(batch)  # the hub batches again inside generate
        tokens = [self.hub.binarize(" ".join(sentence)) for sentence in batch]
        with self.torch.inference_mode():
            hypos = self.hub.generate(tokens, **self.options)
        return [self.hub.tgt_dict.string(h[0]["tokens"]).split() for h in hypos]


# --- input and output -------------------------------------------------------------------------
class _Stdin(os.PathLike):
    """The path LineReader opens for standard input, named as such in its messages."""

    def __fspath__(self):
        return "/dev/stdin"

    def __str__(self):
        return "standard input"


def default_threads():
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else cores


def parse_args(argv):
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", nargs="?", default="-", help="text to translate, one sentence per line (default: stdin)")
    p.add_argument("-o", "--output", help="write the translations here, atomically (default: stdout)")
    p.add_argument("--work-dir", help="the directory prepare.sh wrote for the model: tok/, bpe/ and data-bin/ "
                                      "(needed for --input-format raw and for --engine fairseq)")
    p.add_argument("--data-bin", help="the model's data-bin: dictionaries, bpe_type, languages "
                                      "(default: WORK_DIR/data-bin)")
    p.add_argument("--engine", choices=ENGINES,
                   help="ctranslate2 (default when --model-dir is given) or fairseq (with --checkpoint)")
    p.add_argument("--model-dir", help="a CTranslate2 model directory (fairseq-rope-export), or a directory of "
                                       "length buckets (fairseq-rope-export --length-buckets)")
    p.add_argument("--checkpoint", help="a fairseq checkpoint (.pt) for --engine fairseq")
    p.add_argument("--src", help="source language (default: as recorded in the data-bin)")
    p.add_argument("--tgt", help="target language (default: as recorded in the data-bin)")
    p.add_argument("--beam", type=int, default=4, help="beam size (4)")
    p.add_argument("--lenpen", type=float, default=0.6, help="length penalty (0.6)")
    p.add_argument("--max-len", type=int, default=200,
                   help="at most this many target tokens per sentence (200, fairseq-generate's --max-len-b)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch (64)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="CPU threads (default: $OMP_NUM_THREADS, else the cores this process may use)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--compute-type", default="default",
                   help="CTranslate2: default (the type the model was exported with: float32 unless exported "
                        "with --quantization), float32, int8, int8_float32, float16, bfloat16, ...; "
                        "fairseq: float32, or float16 / bfloat16 on cuda")
    p.add_argument("--input-format", choices=("raw", "bpe"), default="raw",
                   help="raw text (default), or lines already tokenized and BPE'd like bpe/test.SRC")
    p.add_argument("--output-format", choices=("detok", "tok", "bpe"),
                   help="detok: Moses-detokenized text (default); tok: tokenized, BPE removed (as "
                        "evaluate.sh's hyp.tok.TGT); bpe: the model's tokens")
    p.add_argument("--replace-invalid-utf8", action="store_true",
                   help="replace invalid UTF-8 bytes in the input with U+FFFD instead of stopping")
    p.add_argument("--quiet", action="store_true",
                   help="no progress (a bar on a terminal, else a line every tenth of the way) and no summary")
    p.add_argument("--stats-json", help="write the decoding time and speed here as JSON")
    p.add_argument("--max-source-positions", type=int,
                   help="the longest source the model takes, in BPE tokens plus the </s> appended to each "
                        "(default: the model's max_source_positions: from the checkpoint, or recorded in "
                        "export_info.json by fairseq-rope-export); longer lines are refused")
    args = p.parse_args(argv)
    for flag, minimum in (("beam", 1), ("max_len", 1), ("batch_size", 1), ("threads", 1),
                          ("max_source_positions", 2)):
        if getattr(args, flag) is not None and getattr(args, flag) < minimum:
            p.error(f"--{flag.replace('_', '-')} must be at least {minimum}, not {getattr(args, flag)}")
    if args.lenpen != args.lenpen:  # NaN
        p.error("--lenpen must be a number")
    return args


def check_setup(args):
    """Resolve defaults and check every file and flag before any text is read: raises UserError."""
    if args.engine is None:
        if args.model_dir:
            args.engine = "ctranslate2"
        elif args.checkpoint:
            args.engine = "fairseq"
        else:
            raise UserError("give --model-dir (a CTranslate2 export) or --engine fairseq --checkpoint CKPT")
    if args.engine == "ctranslate2":
        if not args.model_dir:
            raise UserError("--engine ctranslate2 needs --model-dir (export one with fairseq-rope-export)")
        if not Path(args.model_dir).is_dir():
            raise UserError(f"--model-dir {args.model_dir} is not a directory")
    else:
        if not args.checkpoint:
            raise UserError("--engine fairseq needs --checkpoint CKPT")
        if not Path(args.checkpoint).is_file():
            raise UserError(f"--checkpoint {args.checkpoint} is not a file")
        if args.compute_type not in FAIRSEQ_COMPUTE_TYPES:
            raise UserError(f"--compute-type {args.compute_type} is for --engine ctranslate2; fairseq takes "
                            f"{', '.join(FAIRSEQ_COMPUTE_TYPES)}")
        if args.compute_type in ("float16", "bfloat16") and args.device != "cuda":
            raise UserError(f"--compute-type {args.compute_type} with --engine fairseq needs --device cuda")
    work_dir = Path(args.work_dir) if args.work_dir else None
    if work_dir is not None and not work_dir.is_dir():
        raise UserError(f"--work-dir {work_dir} is not a directory")
    args.work_dir = work_dir
    args.data_bin = Path(args.data_bin) if args.data_bin else (work_dir / "data-bin" if work_dir else None)
    if args.data_bin is not None and not args.data_bin.is_dir():
        raise UserError(f"--data-bin {args.data_bin} is not a directory" if work_dir is None or
                        args.data_bin != work_dir / "data-bin" else
                        f"--work-dir {work_dir} has no data-bin/: run prepare.sh first (or give --data-bin)")
    if args.input_format == "raw" and work_dir is None:
        raise UserError("--work-dir is needed to tokenize and BPE raw text: the directory prepare.sh wrote "
                        "(or pass --input-format bpe)")
    if args.engine == "fairseq" and args.data_bin is None:
        raise UserError("--engine fairseq needs the model's dictionaries: give --work-dir (or --data-bin)")

    src, tgt = languages_of(args.data_bin)
    if src and tgt and (args.src or src, args.tgt or tgt) != (src, tgt):  # swapped, or one side repeated
        raise UserError(f"--src {args.src or src} --tgt {args.tgt or tgt}: the data-bin {args.data_bin} is for "
                        f"{src}-{tgt} (translating {src} to {tgt}): pass --src {src} --tgt {tgt}, or leave both out")
    args.src, args.tgt = args.src or src, args.tgt or tgt
    tokenized_workdir = work_dir is None or (step_options(work_dir / "tok", "tok") or {}).get("TOKENIZE", "1") != "0"
    if args.output_format is None:
        args.output_format = "detok" if tokenized_workdir else "tok"
        if not tokenized_workdir:
            say(f"{work_dir} was prepared with --no-tokenize: input is taken as tokenized and the output is "
                "left tokenized (--output-format tok)")
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

    args.bpe_type = None
    if args.data_bin is not None and (args.data_bin / "bpe_type").is_file():
        args.bpe_type = (args.data_bin / "bpe_type").read_text(encoding="utf-8").strip()
    elif work_dir is not None:
        bpe = (step_options(work_dir / "bpe", "bpe") or {}).get("BPE")
        args.bpe_type = {"subword-nmt": "subword_nmt", "sentencepiece": "sentencepiece"}.get(bpe)
    if args.bpe_type is None and (args.input_format == "raw" or args.output_format != "bpe"):
        where = args.data_bin or work_dir
        raise UserError(f"cannot tell the BPE kind: {where}/bpe_type is missing" if where else
                        "cannot tell the BPE kind: give --work-dir or --data-bin (its bpe_type file)")
    if args.bpe_type is not None and args.bpe_type not in BPE_TYPES:
        raise UserError(f"{args.data_bin}/bpe_type: unknown BPE kind {args.bpe_type!r} "
                        f"(expected {' or '.join(BPE_TYPES)})")
    if args.input_format == "raw" and not (work_dir / "bpe" / ".done").is_file():
        raise UserError(f"--work-dir {work_dir} has no complete bpe/ step (bpe/.done): run prepare.sh first")

    if args.engine == "ctranslate2" and args.data_bin is not None:
        check_vocabulary(args)
    check_outputs(args)
    if args.input != "-" and not Path(args.input).is_file():
        raise UserError(f"input file {args.input} does not exist" if not Path(args.input).exists()
                        else f"input {args.input} is not a file")


def check_outputs(args):
    """Every file this run will write can be written, before hours of decoding: a writable
    directory (a symlink's target is what gets replaced), not a directory, not the same file twice,
    none of the files it reads; without --output, an open standard output."""
    if args.output is None:
        problem = closed_stdout_problem("--output")
        if problem:
            raise UserError(problem)
    problem = output_files_problem({"--output": args.output, "--stats-json": args.stats_json}, input_files(args))
    if problem:
        raise UserError(problem)


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
        read = ["tok/.done", "bpe/.done"]
        if args.input_format == "raw":
            read += ["bpe/spm.model"] if args.bpe_type == "sentencepiece" else ["bpe/codes", f"bpe/vocab.{args.src}"]
        for name in read:
            inputs[f"--work-dir's {name}"] = args.work_dir / name
    return inputs


FAIRSEQ_SPECIALS = ["<s>", "<blank>", "</s>", "<unk>"]  # a fairseq Dictionary's first symbols, as CTranslate2
# lists them (its converter renames <pad> to <blank>)


def check_vocabulary(args):
    """The CTranslate2 model was exported with this data-bin's dictionaries, token for token in
    the same order: a model's token ids are positions in its vocabulary, so another dictionary,
    or the same tokens in another order, would translate into garbage without a word."""
    model_dir = Path(args.model_dir)
    model_dirs = [model_dir]
    if (model_dir / LENGTH_BUCKETS).is_file():  # each bucket is a model of its own: check every one
        model_dirs = [model_dir / b["directory"] for b in bucket_manifest(model_dir)["buckets"]]
    for directory, (side, lang) in itertools.product(model_dirs, (("source", args.src), ("target", args.tgt))):
        if lang is None:
            continue
        try:
            path, vocab = read_vocabulary(directory, side)
        except (OSError, ValueError) as e:
            raise UserError(f"--model-dir {args.model_dir}: {first_line(e)}: export the model again") from None
        if vocab is None:
            continue
        dictionary = args.data_bin / f"dict.{lang}.txt"
        expected = FAIRSEQ_SPECIALS + dict_tokens(dictionary)
        if vocab != expected:
            index = next((i for i, (a, b) in enumerate(zip(vocab, expected)) if a != b), min(len(vocab), len(expected)))
            raise UserError(f"--model-dir {args.model_dir} was not exported with the dictionary of {args.data_bin}: "
                            f"token {index} of {path} is {_token_at(vocab, index)}, of {dictionary} "
                            f"{_token_at(expected, index, dictionary=True)}: give the work dir / data-bin the model "
                            "was trained on")


def _token_at(tokens, index, dictionary=False):
    if index >= len(tokens):
        return f"past its end ({len(tokens)} tokens)"
    line = index - len(FAIRSEQ_SPECIALS) + 1  # dict.L.txt lists the tokens after the special ones
    return repr(tokens[index]) + (f" (line {line})" if dictionary and line > 0 else "")


def check_lengths(sources, limit, path):
    """Refuse the first source longer than the model takes, with either engine: its tokens plus
    the </s> the model appends must fit in ``limit`` positions (a 24k-token line would otherwise
    take CTranslate2 minutes and gigabytes, or be killed for memory without a word)."""
    if limit is None:
        return
    for number, tokens in enumerate(sources, 1):
        if len(tokens) + 1 > limit:
            raise UserError(f"{path}: line {number} has {len(tokens)} BPE tokens; the model takes at most "
                            f"{limit - 1}: split the line, or raise the limit with --max-source-positions", status=1)


@command
def main(argv=None):
    args = parse_args(argv)
    check_setup(args)
    segment = Segmenter(args.work_dir, args.src, args.bpe_type) if args.input_format == "raw" else str.split
    if args.engine == "fairseq":
        engine = FairseqEngine(args)
    elif (Path(args.model_dir) / LENGTH_BUCKETS).is_file():
        engine = LengthBuckets(args)
    else:
        engine = CTranslate2Engine(args)
    reader = text_tools.LineReader(_Stdin() if args.input == "-" else args.input, args.replace_invalid_utf8)
    lines = list(reader)
    reader.report()
    sources = [segment(line) for line in lines]
    check_lengths(sources, engine.max_source, reader.path)
    progress = not args.quiet and args.input != "-"
    if isinstance(engine, LengthBuckets):
        hyps, seconds = engine.translate_all(sources, args.batch_size, progress)
    else:
        hyps, seconds = translate(engine, sources, args.batch_size, progress)

    if args.output_format != "bpe":
        hyps = [remove_bpe(" ".join(h), args.bpe_type) for h in hyps]
        if args.output_format == "detok":
            from fairseq_rope_tools.checkpoints.score_bleu import (
                moses_detokenize,  # the detokenizer evaluate.sh scores with
            )

            hyps = moses_detokenize(hyps, args.tgt)
    else:
        hyps = [" ".join(h) for h in hyps]
    if args.output is None:
        sys.stdout.reconfigure(encoding="utf-8")  # UTF-8 whatever the locale, as --output is
    try:
        write_lines(args.output, hyps)
    except OSError as e:  # checked before decoding, so only what changed since: a full disk, ...
        raise UserError(f"{f'--output {args.output}' if args.output else 'standard output'}: {e.strerror or e}",
                        status=1) from None

    n = sum(1 for s in sources if s)
    stats = dict(engine=args.engine, sentences=n, lines=len(sources), seconds=round(seconds, 3),
                 sentences_per_second=round(n / seconds, 2) if seconds > 0 else None, beam=args.beam,
                 lenpen=args.lenpen, batch_size=args.batch_size, threads=args.threads, device=args.device,
                 compute_type=args.compute_type)
    if isinstance(engine, LengthBuckets):
        stats["length_buckets"] = dict(training_length=engine.training_length, sentences=engine.sentences)
    if args.stats_json:
        try:
            write_text_atomically(args.stats_json, json.dumps(stats, indent=1) + "\n")
        except OSError as e:
            raise UserError(f"--stats-json {args.stats_json}: {e.strerror or e}", status=1) from None
    if not args.quiet:
        say(f"{len(sources)} lines ({n} to translate) in {seconds:.2f} s of decoding"
            + (f": {stats['sentences_per_second']:.1f} sentences/s" if seconds > 0 else "")
            + f" ({args.engine}, beam {args.beam}, {args.threads} thread{'s' if args.threads != 1 else ''})")
        if isinstance(engine, LengthBuckets):
            say(engine.report())


def translate(engine, sources, batch_size, progress=False):
    """Hypotheses (token lists) for ``sources`` in input order, and the seconds spent decoding.
    Sentences are sorted by length into batches; empty sources give empty hypotheses. ``progress``:
    a bar on a terminal; elsewhere (a log) a plain line every tenth of the way, since a bar is
    redrawn with carriage returns."""
    order = sorted((i for i, s in enumerate(sources) if s), key=lambda i: len(sources[i]))
    hyps = [[] for _ in sources]
    seconds = 0.0
    from tqdm import tqdm

    on_terminal = sys.stderr.isatty()
    lines = progress_sayer("translate") if progress and not on_terminal else None
    tenths = 0
    with tqdm(total=len(order), unit="sent", disable=not (progress and on_terminal), file=sys.stderr,
              dynamic_ncols=True) as bar:
        for start in range(0, len(order), batch_size):
            ids = order[start:start + batch_size]
            began = time.perf_counter()
            out = engine.translate([sources[i] for i in ids])
            seconds += time.perf_counter() - began
            for i, h in zip(ids, out):
                hyps[i] = h
            bar.update(len(ids))
            done = start + len(ids)
            if lines is not None and done * 10 // len(order) > tenths:
                tenths = done * 10 // len(order)
                lines(f"{done}/{len(order)} sentences translated")
    return hyps, seconds


if __name__ == "__main__":
    main()

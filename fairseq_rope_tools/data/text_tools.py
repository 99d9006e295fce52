#!/usr/bin/env python3
"""Text steps of the WMT14 En-De recipe, as Python (sacremoses) equivalents of the Moses scripts.

Sub-commands (each reads and writes plain UTF-8 text, one sentence per line):

``extract --archive A.tgz --dest DIR MEMBER...``
    Copy these members of a gzipped tar archive to DIR/MEMBER, in one pass over it. A member
    that is not a regular file (a symbolic or hard link, a device, a directory) is refused,
    naming the archive and the member: a link would copy whatever file of the machine it names
    into the corpus.
``normalize --output OUT IN...``
    The first step that reads your text: concatenate the inputs into OUT, one sentence per line,
    with lines split only at ``\\n``. Every other character that some tool treats as a line
    break (``\\r``, ``\\v``, ``\\f``, ``\\x1c``-``\\x1e``, U+0085, U+2028, U+2029) becomes a space,
    and a CRLF line end becomes a plain ``\\n``, so that no later tool can split a sentence in
    two and shift one side of a parallel corpus against the other.
``sgm2txt IN.sgm OUT``
    Keep the ``<seg id="...">`` lines of a WMT SGML file, strip the tags (as fairseq's
    prepare-wmt14en2de.sh does).
``tokenize --lang L IN OUT``
    normalize-punctuation.perl -> remove-non-printing-char.perl -> tokenizer.perl -a -no-escape
    (aggressive hyphen splitting: ``well-known`` -> ``well @-@ known``).
``clean --src L1 --tgt L2 --min 1 --max 250 --ratio 1.5 IN_PREFIX OUT_PREFIX``
    clean-corpus-n.perl: drop pairs with an empty side, a side shorter than --min or longer
    than --max tokens, or a length ratio above --ratio.
``detokenize --lang L IN OUT``
    Moses detokenizer (undoes ``@-@`` too).
``spm-train --vocab-size N --model-prefix P IN...``
    Learn a joint sentencepiece BPE model on the (tokenized) training text.
``spm-encode --model M IN OUT``
    Split text into sentencepiece pieces (space separated), as fairseq-preprocess expects.
``record --step S --marker DIR/.done [--base WORK_DIR] [--option K=V]... [--input KEY=PATH]...``
    prepare.sh's step bookkeeping: print whether DIR/.done records exactly these options and
    input files (size and sha256), then the record to store in DIR/.done.
``idx-count FILE.idx``
    Number of sentences in a fairseq mmap index (``?`` for another format).

Every reader splits its input only at ``\\n`` (a last line without ``\\n`` counts as a line) and
decodes it strictly as UTF-8: the first invalid byte stops it with the file name and line number,
unless ``--replace-invalid-utf8`` is given, which replaces invalid bytes with U+FFFD and says in
how many lines it did so. Every output is written to a temporary file beside it and renamed
when complete. Error messages are one line, ``[PREFIX] error: ...`` (PREFIX: $TEXT_TOOLS_PREFIX,
default ``text_tools``).
"""

import os
import re
import shutil
import struct
import sys
import tarfile
import zlib
from multiprocessing import Pool
from pathlib import Path

from fairseq_rope_base.files import (
    file_fingerprint,
    outputs_over_inputs_problem,
    write_atomically,
    write_lines_atomically,
)
from fairseq_rope_tools.cli import ArgumentParser, UserError, command, sayer
from fairseq_rope_tools.text_steps import RECORD_HEADER, CommandLineReader, RecipeTokenizer, parse_step_record

SEG_RE = re.compile(r'<seg id="?\d+"?>\s*(.*?)\s*</seg>\s*$', re.IGNORECASE)
PREFIX = os.environ.get("TEXT_TOOLS_PREFIX", "text_tools")


say = sayer(PREFIX)


# the tokenizer of each worker process of a parallel tokenize
_worker_tokenizer = None


def _start_tokenizing_worker(lang):
    global _worker_tokenizer
    _worker_tokenizer = RecipeTokenizer(lang)


def _tokenize_in_worker(line: str) -> str:
    return _worker_tokenizer(line)


_MEMBER_KINDS = {tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link", tarfile.DIRTYPE: "a directory",
                 tarfile.CHRTYPE: "a character device", tarfile.BLKTYPE: "a block device", tarfile.FIFOTYPE: "a FIFO"}


def cmd_extract(args):
    wanted = {os.path.normpath(m): m for m in args.members}
    found = set()
    try:
        with tarfile.open(args.archive, "r|gz", bufsize=1 << 20) as archive:  # a stream: one pass, no seeking back
            for member in archive:
                name = os.path.normpath(member.name)
                if name not in wanted:
                    continue
                if not member.isreg():
                    kind = _MEMBER_KINDS.get(member.type, f"of tar type {member.type!r}")
                    target = f" to {member.linkname}" if member.issym() or member.islnk() else ""
                    raise UserError(f"archive {args.archive}: member {member.name} is {kind}{target}, not a "
                                    "regular file; refusing it (is it the WMT14 archive?)", status=1)
                out = Path(args.dest) / wanted[name]
                out.parent.mkdir(parents=True, exist_ok=True)
                with archive.extractfile(member) as data, open(out, "wb") as f:
                    shutil.copyfileobj(data, f, 1 << 20)
                found.add(name)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
        raise UserError(f"cannot read archive {args.archive}: {e} (is it the WMT14 archive?)", status=1) from e
    missing = [wanted[n] for n in wanted if n not in found]
    if missing:
        raise UserError(f"archive {args.archive} has no member {', '.join(missing)} (is it the WMT14 archive?)",
                        status=1)


def cmd_normalize(args):
    readers = [CommandLineReader(path, args.replace_invalid_utf8) for path in args.inputs]

    def all_lines():
        for reader in readers:
            yield from reader

    n = write_lines_atomically(args.output, all_lines())
    for reader in readers:
        reader.report(say)
    print(f"[normalize] {', '.join(args.inputs)} -> {args.output}: {n} lines", file=sys.stderr)


def cmd_sgm2txt(args):
    segs = []
    reader = CommandLineReader(args.input, args.replace_invalid_utf8)
    for line in reader:
        m = SEG_RE.search(line)
        if m:
            segs.append(m.group(1).replace("\u2019", "'"))
    if not segs:
        raise UserError(f"no <seg id=...> lines in {args.input}: is it a WMT .sgm file?", status=1)
    reader.report(say)
    n = write_lines_atomically(args.output, segs)
    print(f"[sgm2txt] {args.input}: {n} segments", file=sys.stderr)


def cmd_tokenize(args):
    reader = CommandLineReader(args.input, args.replace_invalid_utf8)
    lines = list(reader)
    reader.report(say)
    if args.workers > 1 and len(lines) > 20000:
        with Pool(args.workers, initializer=_start_tokenizing_worker, initargs=(args.lang,)) as pool:
            out = pool.imap(_tokenize_in_worker, lines, chunksize=2000)
            n = write_lines_atomically(args.output, out)
    else:
        tokenize = RecipeTokenizer(args.lang)
        n = write_lines_atomically(args.output, (tokenize(line) for line in lines))
    print(f"[tokenize] {args.input} ({args.lang}): {n} lines", file=sys.stderr)


def cmd_detokenize(args):
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=args.lang)
    reader = CommandLineReader(args.input, args.replace_invalid_utf8)
    lines = [detok.detokenize(line.split()) for line in reader]
    reader.report(say)
    write_lines_atomically(args.output, lines)


def keep_pair(src: str, tgt: str, lo: int, hi: int, ratio: float) -> bool:
    ns, nt = len(src.split()), len(tgt.split())
    if ns == 0 or nt == 0:
        return False
    if ns < lo or nt < lo or ns > hi or nt > hi:
        return False
    return ns / nt <= ratio and nt / ns <= ratio


def cmd_clean(args):
    s_in, t_in = f"{args.in_prefix}.{args.src}", f"{args.in_prefix}.{args.tgt}"
    s_out, t_out = f"{args.out_prefix}.{args.src}", f"{args.out_prefix}.{args.tgt}"
    rs, rt = CommandLineReader(s_in, args.replace_invalid_utf8), CommandLineReader(t_in, args.replace_invalid_utf8)
    kept = total = 0

    def write_pairs(s_tmp, t_tmp):
        nonlocal kept, total
        with open(s_tmp, "w", encoding="utf-8", newline="\n") as os_, \
                open(t_tmp, "w", encoding="utf-8", newline="\n") as ot:
            it_s, it_t = iter(rs), iter(rt)
            for s, t in zip(it_s, it_t):
                total += 1
                s, t = " ".join(s.split()), " ".join(t.split())
                if keep_pair(s, t, args.min, args.max, args.ratio):
                    os_.write(s + "\n")
                    ot.write(t + "\n")
                    kept += 1
            # zip stops at the shorter side: count what is left of either
            rest_s, rest_t = sum(1 for _ in it_s), sum(1 for _ in it_t)
            if rest_s or rest_t:
                raise UserError(f"{s_in} ({total + rest_s} lines) and {t_in} ({total + rest_t} lines) "
                                f"are not parallel", status=1)

    # Both sides or neither: the target's write runs inside the source's, so both temporary files
    # are complete before either is renamed, and a failure removes both.
    write_atomically(s_out, lambda s_tmp: write_atomically(t_out, lambda t_tmp: write_pairs(s_tmp, t_tmp)))
    rs.report(say)
    rt.report(say)
    print(f"[clean] {args.in_prefix}: kept {kept} of {total} pairs", file=sys.stderr)


def cmd_spm_train(args):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        input=",".join(args.inputs), model_prefix=args.model_prefix, vocab_size=args.vocab_size,
        model_type="bpe", character_coverage=1.0, input_sentence_size=args.sample,
        shuffle_input_sentence=True, num_threads=args.workers, minloglevel=1,
    )


def cmd_spm_encode(args):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=args.model)
    reader = CommandLineReader(args.input, args.replace_invalid_utf8)
    write_lines_atomically(args.output, (" ".join(sp.encode(line, out_type=str)) for line in reader))
    reader.report(say)


# --- step bookkeeping for prepare.sh --------------------------------------------------------
# A step's DIR/.done records what the step was built from: the options that change its output
# and, for every input file, its size and sha256. prepare.sh redoes a step whose record differs,
# which makes every later step see changed inputs too. The inputs are hashed in full, since
# size+mtime or partial hashes would miss an edited or re-extracted file of the same size (what
# that costs: examples/wmt14_en_de/README.md). (The record's format: text_steps.py.)


def _describe_changes(old, new):
    (old_opts, old_inputs), (new_opts, new_inputs) = old, new
    reasons = []
    changed = [f"{k} {old_opts.get(k, '(unset)')} -> {new_opts.get(k, '(unset)')}"
               for k in list(new_opts) + [k for k in old_opts if k not in new_opts]
               if old_opts.get(k) != new_opts.get(k)]
    if changed:
        reasons.append(f"options changed ({', '.join(changed)})")
    keys = list(new_inputs) + [k for k in old_inputs if k not in new_inputs]
    changed = []
    for k in keys:
        o, n = old_inputs.get(k), new_inputs.get(k)
        if o is not None and n is not None and o[:2] == n[:2]:
            continue
        if o is None:
            changed.append(f"{k} is new")
        elif n is None:
            changed.append(f"{k} is no longer an input")
        elif n[0] == "missing":
            changed.append(f"{k} is missing ({n[2]})")
        elif o[2] != n[2]:
            changed.append(f"{k} is now {n[2]}, was {o[2]}")
        else:
            changed.append(k)
    if changed:
        more = f", and {len(changed) - 4} more" if len(changed) > 4 else ""
        reasons.append(f"inputs changed ({', '.join(changed[:4])}{more})")
    return "; ".join(reasons)


def cmd_record(args):
    """Print one status line -- ``new`` (no marker), ``same`` (the marker records exactly these
    options and inputs) or why it differs -- then the record to write to the marker."""
    old = None
    if os.path.exists(args.marker):
        with open(args.marker, encoding="utf-8", errors="replace") as f:
            old = parse_step_record(f.read())
    options = {}
    for spec in args.option:
        name, sep, value = spec.partition("=")
        if not sep or not name:
            raise UserError(f"record: --option needs NAME=VALUE, not {spec!r}", status=1)
        options[name] = value
    base = os.path.abspath(args.base) if args.base else None

    def shown(path):  # paths under --base (WORK_DIR) are kept relative: a moved WORK_DIR is the same
        path = os.path.abspath(path)
        return os.path.relpath(path, base) if base and path.startswith(base + os.sep) else path

    inputs, gone = {}, []
    for spec, optional in [(s, False) for s in args.input] + [(s, True) for s in args.optional_input]:
        key, sep, path = spec.partition("=")
        if not sep or not key or " " in key:
            raise UserError(f"record: --input needs KEY=PATH (no space in KEY), not {spec!r}", status=1)
        if os.path.isfile(path):
            inputs[key] = (*file_fingerprint(path), shown(path))
        elif optional:
            # gone since the step was built (e.g. downloaded archives deleted to save space):
            # trust the record of the file it was built from
            if old is not None and key in old[1]:
                inputs[key] = old[1][key]
                gone.append(shown(path))
            else:
                inputs[key] = ("missing", "-", shown(path))
        else:
            raise UserError(f"{args.step}: input file {path} is missing", status=1)
    if gone:
        say(f"{args.step}: {', '.join(gone)} {'is' if len(gone) == 1 else 'are'} gone; taking "
            f"{'it' if len(gone) == 1 else 'them'} to be what {args.step} was built from")
    if not os.path.exists(args.marker):
        status = "new"
    elif old is None:
        status = f"{args.marker} does not record the step's inputs (written by an older prepare.sh)"
    else:
        status = _describe_changes(old, (options, inputs)) or "same"
    out = [status, RECORD_HEADER]
    out += [f"option {k}={v}" for k, v in options.items()]
    out += [f"input {k} {size} {sha} {path}" for k, (size, sha, path) in inputs.items()]
    print("\n".join(out))


def cmd_idx_count(args):
    """Sentences in a fairseq MMapIndexedDataset index: magic, <Q version, <B dtype, <Q count."""
    with open(args.index, "rb") as f:
        head = f.read(26)
    if len(head) == 26 and head[:9] == b"MMIDIDX\x00\x00":
        print(struct.unpack("<Q", head[18:26])[0])
    else:
        print("?")


@command(label=f"[{PREFIX}]")
def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    reader = ArgumentParser(add_help=False)
    reader.add_argument("--replace-invalid-utf8", action="store_true",
                        help="replace invalid UTF-8 bytes with U+FFFD instead of stopping")

    def command(name, func, *positionals, reads_text=True):
        """Sub-command ``name`` running ``func``, with these positional arguments (``inputs``: one
        or more) and, where it reads text, --replace-invalid-utf8."""
        a = sub.add_parser(name, parents=[reader] if reads_text else [])
        for positional in positionals:
            a.add_argument(positional, nargs="+" if positional in ("inputs", "members") else None)
        a.set_defaults(func=func)
        return a

    a = command("extract", cmd_extract, "members", reads_text=False)
    a.add_argument("--archive", required=True)
    a.add_argument("--dest", required=True)
    command("normalize", cmd_normalize, "inputs").add_argument("--output", required=True)
    command("sgm2txt", cmd_sgm2txt, "input", "output")
    a = command("tokenize", cmd_tokenize, "input", "output")
    a.add_argument("--lang", required=True)
    a.add_argument("--workers", type=int, default=1)
    command("detokenize", cmd_detokenize, "input", "output").add_argument("--lang", required=True)
    a = command("clean", cmd_clean, "in_prefix", "out_prefix")
    a.add_argument("--src", required=True)
    a.add_argument("--tgt", required=True)
    a.add_argument("--min", type=int, default=1)
    a.add_argument("--max", type=int, default=250)
    a.add_argument("--ratio", type=float, default=1.5)
    a = command("spm-train", cmd_spm_train, "inputs", reads_text=False)
    a.add_argument("--vocab-size", type=int, required=True)
    a.add_argument("--model-prefix", required=True)
    a.add_argument("--sample", type=int, default=4000000, help="sentences sampled for training")
    a.add_argument("--workers", type=int, default=1)
    command("spm-encode", cmd_spm_encode, "input", "output").add_argument("--model", required=True)
    a = command("record", cmd_record, reads_text=False)
    a.add_argument("--step", required=True)
    a.add_argument("--marker", required=True)
    a.add_argument("--base", help="record input paths under this directory relative to it")
    a.add_argument("--option", action="append", default=[], metavar="NAME=VALUE")
    a.add_argument("--input", action="append", default=[], metavar="KEY=PATH")
    a.add_argument("--optional-input", action="append", default=[], metavar="KEY=PATH",
                   help="an input that may have been deleted since: then its recorded fingerprint is used")
    command("idx-count", cmd_idx_count, "index", reads_text=False)
    args = p.parse_args(argv)
    problem = outputs_over_inputs_problem(*step_paths(args))
    if problem:
        raise UserError(f"{args.cmd}: {problem}")
    args.func(args)


def step_paths(args):
    """({output: path}, {input: path}) of a sub-command's command line, for the output rule."""
    if args.cmd == "clean":
        sides = (args.src, args.tgt)
        return ({f"OUT_PREFIX's .{side}": f"{args.out_prefix}.{side}" for side in sides},
                {f"IN_PREFIX's .{side}": f"{args.in_prefix}.{side}" for side in sides})
    if args.cmd == "spm-train":
        outputs = {"--model-prefix's .model": f"{args.model_prefix}.model",
                   "--model-prefix's .vocab": f"{args.model_prefix}.vocab"}
    elif args.cmd == "extract":
        outputs = {f"--dest's {member}": os.path.join(args.dest, member) for member in args.members}
    else:
        outputs = {"--output" if args.cmd == "normalize" else "OUT": getattr(args, "output", None)}
    inputs = {"IN": getattr(args, "input", None) or getattr(args, "inputs", None),
              "--archive": getattr(args, "archive", None), "--model": getattr(args, "model", None)}
    return outputs, inputs

if __name__ == "__main__":
    main()

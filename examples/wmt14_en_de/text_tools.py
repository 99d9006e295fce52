#!/usr/bin/env python3
"""Text steps of the WMT14 En-De recipe, as Python (sacremoses) equivalents of the Moses scripts.

Sub-commands (each reads and writes plain UTF-8 text, one sentence per line):

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

Every output is written to ``OUT.tmp`` and renamed when complete.
"""

import argparse
import os
import re
import sys
import unicodedata
from multiprocessing import Pool

SEG_RE = re.compile(r'<seg id="?\d+"?>\s*(.*?)\s*</seg>\s*$', re.IGNORECASE)


def remove_non_printing(text: str) -> str:
    """remove-non-printing-char.perl: every character of Unicode category C* becomes a space."""
    return "".join(" " if unicodedata.category(ch).startswith("C") else ch for ch in text)


class _Tok:
    normalizer = None
    tokenizer = None


def _init_tokenizer(lang):
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    _Tok.normalizer = MosesPunctNormalizer(lang=lang)
    _Tok.tokenizer = MosesTokenizer(lang=lang)


def tokenize_line(line: str) -> str:
    line = _Tok.normalizer.normalize(line.rstrip("\n"))
    line = remove_non_printing(line)
    return _Tok.tokenizer.tokenize(line, aggressive_dash_splits=True, return_str=True, escape=False)


def _write_atomic(path, lines):
    tmp = path + ".tmp"
    count = 0
    with open(tmp, "w", encoding="utf-8") as out:
        for line in lines:
            out.write(line + "\n")
            count += 1
    os.replace(tmp, path)
    return count


def cmd_sgm2txt(args):
    segs = []
    with open(args.input, encoding="utf-8") as f:
        for line in f:
            m = SEG_RE.search(line)
            if m:
                segs.append(m.group(1).replace("\u2019", "'"))
    if not segs:
        sys.exit(f"error: no <seg id=...> lines in {args.input}: is it a WMT .sgm file?")
    n = _write_atomic(args.output, segs)
    print(f"[sgm2txt] {args.input}: {n} segments", file=sys.stderr)


def cmd_tokenize(args):
    with open(args.input, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    if args.workers > 1 and len(lines) > 20000:
        with Pool(args.workers, initializer=_init_tokenizer, initargs=(args.lang,)) as pool:
            out = pool.imap(tokenize_line, lines, chunksize=2000)
            n = _write_atomic(args.output, out)
    else:
        _init_tokenizer(args.lang)
        n = _write_atomic(args.output, (tokenize_line(line) for line in lines))
    print(f"[tokenize] {args.input} ({args.lang}): {n} lines", file=sys.stderr)


def cmd_detokenize(args):
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=args.lang)
    with open(args.input, encoding="utf-8") as f:
        lines = [detok.detokenize(line.split()) for line in f]
    _write_atomic(args.output, lines)


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
    kept = total = 0
    with open(s_in, encoding="utf-8") as fs, open(t_in, encoding="utf-8") as ft, \
            open(s_out + ".tmp", "w", encoding="utf-8") as os_, open(t_out + ".tmp", "w", encoding="utf-8") as ot:
        for s, t in zip(fs, ft):
            total += 1
            s, t = " ".join(s.split()), " ".join(t.split())
            if keep_pair(s, t, args.min, args.max, args.ratio):
                os_.write(s + "\n")
                ot.write(t + "\n")
                kept += 1
        if fs.readline() or ft.readline():
            sys.exit(f"error: {s_in} and {t_in} have different numbers of lines")
    os.replace(s_out + ".tmp", s_out)
    os.replace(t_out + ".tmp", t_out)
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
    with open(args.input, encoding="utf-8") as f:
        lines = (" ".join(sp.encode(line.rstrip("\n"), out_type=str)) for line in f)
        _write_atomic(args.output, lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("sgm2txt")
    a.add_argument("input")
    a.add_argument("output")
    a.set_defaults(func=cmd_sgm2txt)
    a = sub.add_parser("tokenize")
    a.add_argument("--lang", required=True)
    a.add_argument("--workers", type=int, default=1)
    a.add_argument("input")
    a.add_argument("output")
    a.set_defaults(func=cmd_tokenize)
    a = sub.add_parser("detokenize")
    a.add_argument("--lang", required=True)
    a.add_argument("input")
    a.add_argument("output")
    a.set_defaults(func=cmd_detokenize)
    a = sub.add_parser("clean")
    a.add_argument("--src", required=True)
    a.add_argument("--tgt", required=True)
    a.add_argument("--min", type=int, default=1)
    a.add_argument("--max", type=int, default=250)
    a.add_argument("--ratio", type=float, default=1.5)
    a.add_argument("in_prefix")
    a.add_argument("out_prefix")
    a.set_defaults(func=cmd_clean)
    a = sub.add_parser("spm-train")
    a.add_argument("--vocab-size", type=int, required=True)
    a.add_argument("--model-prefix", required=True)
    a.add_argument("--sample", type=int, default=4000000, help="sentences sampled for training")
    a.add_argument("--workers", type=int, default=1)
    a.add_argument("inputs", nargs="+")
    a.set_defaults(func=cmd_spm_train)
    a = sub.add_parser("spm-encode")
    a.add_argument("--model", required=True)
    a.add_argument("input")
    a.add_argument("output")
    a.set_defaults(func=cmd_spm_encode)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Score translations two ways: tokenized BLEU with compound splitting, and sacreBLEU.

1. **Tokenized BLEU with compound splitting** -- the convention behind the WMT14 En-De numbers of
   Vaswani et al. (27.3 base) and RoFormer (27.5): hypothesis and reference are Moses-tokenized
   (``tokenizer.perl -a``; fairseq-generate output after ``--remove-bpe`` already is), every
   hyphen between two non-space characters is rewritten ``a-b`` -> ``a ##AT##-##AT## b``
   (tensor2tensor's get_ende_bleu.sh, fairseq's compound_split_bleu.sh), and BLEU is computed on
   the whitespace tokens (sacreBLEU with ``tokenize='none'`` and no smoothing, i.e.
   multi-bleu.perl / fairseq-score).
2. **sacreBLEU** on detokenized text: the tokenized hypotheses are detokenized with the Moses
   detokenizer (sacremoses) and scored against the raw, untokenized reference with sacreBLEU's
   default 13a tokenizer; the signature is reported with the score.

    python scripts/score_bleu.py --hyp hyp.tok.de --ref test.tok.de --raw-ref test.de --lang de \\
        --out-json scores.json --detok-out hyp.detok.de

With ``--tokenize``, ``--hyp`` and ``--ref`` are plain text and are Moses-tokenized (``-a``) first.
"""

import argparse
import json
import os
import re
import sys

from sacrebleu.metrics import BLEU

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import text_lines  # noqa: E402
from text_lines import InputError  # noqa: E402

COMPOUND_RE = re.compile(r"(\S)-(\S)")


def compound_split(line: str) -> str:
    """perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'"""
    return COMPOUND_RE.sub(r"\1 ##AT##-##AT## \2", line)


def read_lines(path):
    """The lines of a text file, read strictly (scripts/text_lines.py): a missing, unreadable or
    non-UTF-8 file stops the script with one line naming it (and the line of the first bad byte)."""
    try:
        return text_lines.read_lines(path)
    except InputError as e:
        sys.exit(f"error: {e}")


def moses_tokenize(lines, lang):
    from sacremoses import MosesTokenizer

    tok = MosesTokenizer(lang=lang)
    return [tok.tokenize(line, aggressive_dash_splits=True, return_str=True, escape=False) for line in lines]


def moses_detokenize(lines, lang):
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=lang)
    return [detok.detokenize(line.split()) for line in lines]


def tokenized_bleu(hyps, refs):
    """Compound-split tokenized BLEU (multi-bleu.perl on ``##AT##``-split tokens)."""
    bleu = BLEU(tokenize="none", smooth_method="none", force=True)
    return bleu.corpus_score([compound_split(h) for h in hyps], [[compound_split(r) for r in refs]]), bleu


def sacre_bleu(detok_hyps, raw_refs):
    bleu = BLEU()
    return bleu.corpus_score(detok_hyps, [raw_refs]), bleu


def _summary(score):
    return {
        "score": round(score.score, 2),
        "precisions": [round(p, 1) for p in score.precisions],
        "bp": round(score.bp, 3),
        "sys_len": score.sys_len,
        "ref_len": score.ref_len,
    }


def _check_same_length(a, b, name_a, name_b):
    if len(a) != len(b):
        sys.exit(f"error: {name_a} has {len(a)} lines but {name_b} has {len(b)}; they must be parallel")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hyp", required=True, help="hypotheses, Moses-tokenized, one per line, in test-set order")
    p.add_argument("--ref", required=True, help="reference, Moses-tokenized the same way")
    p.add_argument("--raw-ref", help="untokenized reference for sacreBLEU (omit to skip sacreBLEU)")
    p.add_argument("--lang", default="de", help="target language for the Moses (de)tokenizer")
    p.add_argument("--tokenize", action="store_true", help="--hyp and --ref are plain text: Moses-tokenize them first")
    p.add_argument("--detok-out", help="write the detokenized hypotheses here")
    p.add_argument("--out-json", help="write the scores (and sacreBLEU signature) here as JSON")
    args = p.parse_args(argv)

    hyps, refs = read_lines(args.hyp), read_lines(args.ref)
    _check_same_length(hyps, refs, args.hyp, args.ref)
    if not hyps:
        sys.exit(f"error: {args.hyp} and {args.ref} are empty: there is nothing to score")
    if args.tokenize:
        hyps, refs = moses_tokenize(hyps, args.lang), moses_tokenize(refs, args.lang)
    tok_score, _ = tokenized_bleu(hyps, refs)
    result = {"tokenized_bleu_compound_split": _summary(tok_score)}
    print(f"Tokenized BLEU (compound split): {tok_score.score:.2f}  "
          f"({'/'.join(f'{p:.1f}' for p in tok_score.precisions)}, BP={tok_score.bp:.3f}, "
          f"hyp_len={tok_score.sys_len}, ref_len={tok_score.ref_len})")

    if args.raw_ref:
        raw_refs = read_lines(args.raw_ref)
        _check_same_length(hyps, raw_refs, args.hyp, args.raw_ref)
        detok = moses_detokenize(hyps, args.lang)
        if args.detok_out:
            with open(args.detok_out + ".tmp", "w", encoding="utf-8") as f:
                f.writelines(line + "\n" for line in detok)
            os.replace(args.detok_out + ".tmp", args.detok_out)
        sb_score, sb = sacre_bleu(detok, raw_refs)
        signature = str(sb.get_signature())
        result["sacrebleu"] = dict(_summary(sb_score), signature=signature)
        print(f"sacreBLEU: {sb_score.score:.2f}  signature: {signature}")

    if args.out_json:
        with open(args.out_json + ".tmp", "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        os.replace(args.out_json + ".tmp", args.out_json)
    return result


if __name__ == "__main__":
    main()

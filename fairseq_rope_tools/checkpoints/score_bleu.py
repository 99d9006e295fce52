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
3. **chrF++** (sacreBLEU's chrF with word bigrams) on the same detokenized text, with its signature.

    fairseq-rope-score --hyp hyp.tok.de --ref test.tok.de --raw-ref test.de --lang de \\
        --out-json scores.json --detok-out hyp.detok.de

With ``--tokenize``, ``--hyp`` and ``--ref`` are plain text and are Moses-tokenized (``-a``) first.
``--out-json`` and ``--detok-out`` are checked before any scoring: a file in an existing, writable
directory, not one of the inputs.
"""

import json

from fairseq_rope_base.files import output_files_problem, write_lines_atomically, write_text_atomically
from fairseq_rope_tools import text_lines
from fairseq_rope_tools.cli import ArgumentParser, UserError, command
from fairseq_rope_tools.metrics import moses_detokenize, moses_tokenize, score_all


def _check_same_length(a, b, name_a, name_b):
    if len(a) != len(b):
        raise UserError(f"{name_a} has {len(a)} lines but {name_b} has {len(b)}; they must be parallel", status=1)


def outputs_problem(args):
    """Why the command line's outputs cannot be written, as one line, or None; checked before any work."""
    return output_files_problem({"--out-json": args.out_json, "--detok-out": args.detok_out},
                                {"--hyp": args.hyp, "--ref": args.ref, "--raw-ref": args.raw_ref})


def run(argv=None) -> dict:
    """The command line's scores, as written by --out-json."""
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hyp", required=True, help="hypotheses, Moses-tokenized, one per line, in test-set order")
    p.add_argument("--ref", required=True, help="reference, Moses-tokenized the same way")
    p.add_argument("--raw-ref", help="untokenized reference for sacreBLEU (omit to skip sacreBLEU)")
    p.add_argument("--lang", default="de", help="target language for the Moses (de)tokenizer")
    p.add_argument("--tokenize", action="store_true", help="--hyp and --ref are plain text: Moses-tokenize them first")
    p.add_argument("--detok-out", help="write the detokenized hypotheses here")
    p.add_argument("--out-json", help="write the scores (and sacreBLEU signature) here as JSON")
    args = p.parse_args(argv)
    problem = outputs_problem(args)
    if problem:
        raise UserError(problem)

    # read strictly: a missing, unreadable or non-UTF-8 file is one line naming it (and the line of its first bad byte)
    hyps, refs = text_lines.read_lines(args.hyp), text_lines.read_lines(args.ref)
    _check_same_length(hyps, refs, args.hyp, args.ref)
    if not hyps:
        raise UserError(f"{args.hyp} and {args.ref} are empty: there is nothing to score", status=1)
    if args.tokenize:
        hyps, refs = moses_tokenize(hyps, args.lang), moses_tokenize(refs, args.lang)
    raw_refs = None
    if args.raw_ref:
        raw_refs = text_lines.read_lines(args.raw_ref)
        _check_same_length(hyps, raw_refs, args.hyp, args.raw_ref)
    result, detok = score_all(hyps, refs, raw_refs, args.lang)
    # the files first: a reader of the printed lines that goes away (| head) does not lose them
    if args.detok_out:  # detokenizing needs no reference
        write_lines_atomically(args.detok_out, detok if detok is not None else moses_detokenize(hyps, args.lang))
    if args.out_json:
        write_text_atomically(args.out_json, json.dumps(result, indent=2) + "\n")
    tok = result["tokenized_bleu_compound_split"]
    print(f"Tokenized BLEU (compound split): {tok['score']:.2f}  "
          f"({'/'.join(f'{p:.1f}' for p in tok['precisions'])}, BP={tok['bp']:.3f}, "
          f"hyp_len={tok['sys_len']}, ref_len={tok['ref_len']})")
    if raw_refs is not None:
        print(f"sacreBLEU: {result['sacrebleu']['score']:.2f}  signature: {result['sacrebleu']['signature']}")
        print(f"chrF++: {result['chrf++']['score']:.2f}  signature: {result['chrf++']['signature']}")
    return result


@command
def main(argv=None) -> None:
    run(argv)


if __name__ == "__main__":
    main()

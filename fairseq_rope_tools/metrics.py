"""The scores every tool reports, as fairseq-rope-score computes them (its --help says how):
tokenized BLEU with compound splitting, detokenized sacreBLEU and chrF++, and the Moses
(de)tokenization they rest on; the metrics as sacreBLEU objects for the significance tests."""

import re

from sacrebleu.metrics import BLEU, CHRF

COMPOUND_RE = re.compile(r"(\S)-(\S)")


def compound_split(line: str) -> str:
    """perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'"""
    return COMPOUND_RE.sub(r"\1 ##AT##-##AT## \2", line)


def moses_tokenize(lines, lang):
    from sacremoses import MosesTokenizer

    tok = MosesTokenizer(lang=lang)
    return [tok.tokenize(line, aggressive_dash_splits=True, return_str=True, escape=False) for line in lines]


def moses_detokenize(lines, lang):
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang=lang)
    return [detok.detokenize(line.split()) for line in lines]


# The metrics as sacreBLEU objects, for scoring and for sacreBLEU's significance tests
# (research/significance.py): tokenized BLEU takes compound-split lines, the others detokenized ones.
def tokenized_bleu_metric():
    """multi-bleu.perl: BLEU on whitespace tokens, no smoothing."""
    return BLEU(tokenize="none", smooth_method="none", force=True)


def sacrebleu_metric():
    return BLEU()


def chrf_pp_metric():
    return CHRF(word_order=2)


def tokenized_bleu(hyps, refs):
    """Compound-split tokenized BLEU (multi-bleu.perl on ``##AT##``-split tokens)."""
    bleu = tokenized_bleu_metric()
    return bleu.corpus_score([compound_split(h) for h in hyps], [[compound_split(r) for r in refs]]), bleu


def sacre_bleu(detok_hyps, raw_refs):
    bleu = sacrebleu_metric()
    return bleu.corpus_score(detok_hyps, [raw_refs]), bleu


def chrf_pp(detok_hyps, raw_refs):
    chrf = chrf_pp_metric()
    return chrf.corpus_score(detok_hyps, [raw_refs]), chrf


def _summary(score):
    return {
        "score": round(score.score, 2),
        "precisions": [round(p, 1) for p in score.precisions],
        "bp": round(score.bp, 3),
        "sys_len": score.sys_len,
        "ref_len": score.ref_len,
    }


def score_all(hyps, refs, raw_refs=None, lang="de", detok_hyps=None):
    """The scores of tokenized hypotheses ``hyps`` against the tokenized references ``refs``:
    ``{"tokenized_bleu_compound_split": {...}}``, and with untokenized references ``raw_refs``
    also ``"sacrebleu"`` and ``"chrf++"`` (each with its signature) of the Moses-detokenized
    hypotheses (``detok_hyps`` when already at hand). Returns (scores, detokenized hypotheses or
    None); all lists are in the same order and of the same length."""
    tok_score, _ = tokenized_bleu(hyps, refs)
    result = {"tokenized_bleu_compound_split": _summary(tok_score)}
    if raw_refs is None:
        return result, None
    if detok_hyps is None:
        detok_hyps = moses_detokenize(hyps, lang)
    sb_score, sb = sacre_bleu(detok_hyps, raw_refs)
    result["sacrebleu"] = dict(_summary(sb_score), signature=str(sb.get_signature()))
    chrf_score, chrf = chrf_pp(detok_hyps, raw_refs)
    result["chrf++"] = {"score": round(chrf_score.score, 2), "signature": str(chrf.get_signature())}
    return result, detok_hyps

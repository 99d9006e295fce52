"""``--too-long split``: a line longer than the model takes is split into sentences by a
maintained sentence segmenter (sentencex, about 300 languages), the sentences are translated as
sources of their own in the same batches as the other lines, and their translations are joined
back into one line, in order.

sentencex loads when a line is split, and never torch or fairseq.
"""

from typing import List

from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy.engine import Hypothesis

#: the bytes of a line read whole to be split (beyond, --too-long-sentence applies to the whole line,
#: as to a line over the cap of one source: batching.line_byte_cap)
PARAGRAPH_BYTES = 1 << 20


def sentence_splitter(language: str):
    """raw text -> its sentences in ``language``'s rules, without empty ones (text in a language
    sentencex has no rules for comes back whole)."""
    try:
        import sentencex
    except ImportError:
        raise UserError("--too-long split needs sentencex, which is not installed: pip install sentencex "
                        "(make setup installs it)") from None

    def split(text: str) -> List[str]:
        return [sentence.strip() for sentence in sentencex.segment(language, text) if sentence.strip()]

    return split


def joined(pieces: List[List[Hypothesis]], nbest: int) -> List[Hypothesis]:
    """The hypotheses of a line from those of its sentences, in order: the k-th joins each
    sentence's k-th (its last when it has fewer), its score the mean of theirs; a sentence
    without any (skipped) is left out."""
    pieces = [hypotheses for hypotheses in pieces if hypotheses]
    if not pieces:
        return []
    count = min(nbest, max(len(hypotheses) for hypotheses in pieces))
    out = []
    for k in range(count):
        chosen = [hypotheses[min(k, len(hypotheses) - 1)] for hypotheses in pieces]
        tokens = [token for hypothesis in chosen for token in hypothesis.tokens]
        out.append(Hypothesis(tokens, sum(hypothesis.score for hypothesis in chosen) / len(chosen)))
    return out


def rejoined(results: List[List[Hypothesis]], pieces: List[range], nbest: int) -> List[List[Hypothesis]]:
    """The hypotheses of each input from those of its sources: ``pieces`` holds, per input, the
    positions of its sources in ``results``, one for an input translated whole, its sentences' for
    one split (:func:`joined`)."""
    return [results[positions[0]] if len(positions) == 1 else joined([results[i] for i in positions], nbest)
            for positions in pieces]

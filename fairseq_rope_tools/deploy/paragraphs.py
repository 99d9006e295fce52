"""``--too-long split``: a line longer than the model takes is split into sentences by a
maintained sentence segmenter (sentencex, about 300 languages), the sentences are translated as
sources of their own in the same batches as the other lines, and their translations are joined
back into one line, in order.

sentencex loads when a line is split, and never torch or fairseq.
"""

from typing import Callable, List, Optional, Tuple

from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy.batching import certainly_too_long, fits
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


def add_sentences_per_input_argument(p, what: str) -> None:
    """--max-sentences-per-input, of fairseq-rope-translate (``what``: "line") and -serve ("text")."""
    p.add_argument("--max-sentences-per-input", type=int, metavar="N",
                   help=f"with --too-long split: translate a {what} of more than N sentences N at a time, joined "
                        "back (1: each sentence alone, the sentence-split oracle; a model trained on joined pairs "
                        "takes more)")


def check_sentences_per_input(p, args) -> None:
    """parser error for a --max-sentences-per-input below 1 or without --too-long split."""
    if args.max_sentences_per_input is not None and (args.max_sentences_per_input < 1 or args.too_long != "split"):
        p.error(f"--max-sentences-per-input {args.max_sentences_per_input}: give a number >= 1, with --too-long split")


def sentence_groups(sentences: List[str], size: int, segment: Callable[[str], List[str]],
                    limit: Optional[int]) -> List[Tuple[int, str, Optional[List[str]]]]:
    """The sources of a text split into ``sentences``, ``size`` of them joined at a time: (the
    index of its first sentence, its text, its tokens); a group that does not fit in ``limit`` as
    its sentences, one by one, each with tokens None (the caller segments and checks a sentence
    by its own rule). A group that cannot fit whatever its segmentation is not segmented."""
    groups = []
    for start in range(0, len(sentences), size):
        group = sentences[start:start + size]
        if len(group) > 1:
            text = " ".join(group)
            tokens = None if certainly_too_long(text, limit) else segment(text)
            if tokens is not None and fits(tokens, limit):
                groups.append((start, text, tokens))
                continue
        groups += [(start + k, sentence, None) for k, sentence in enumerate(group)]
    return groups


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

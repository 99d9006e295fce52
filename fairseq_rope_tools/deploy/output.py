"""What fairseq-rope-translate writes for each input line, in input order.

Plain text (the default): ``nbest`` lines per input line, its hypotheses best first (one line
per input line without ``--nbest``); a line with fewer hypotheses -- an empty line, a line
skipped as too long -- gets empty lines in their place, so that input line k is always output
lines (k - 1) * nbest + 1 to k * nbest.

JSON lines (``--json-lines``): one object per input line,
``{"line": 3, "translations": [{"text": "...", "score": -0.42}, ...]}``, best first; ``score`` is
the engine's own (the hypothesis' log-probability, natural log, divided by its length to the
power --lenpen: CTranslate2's ``TranslationResult.scores``, fairseq's hypothesis ``score``); a line
skipped as too long has no translations and ``"skipped": "too long"``, a truncated one
``"truncated": true``, one split into sentences (``--too-long split``) ``"split": true``.
"""

import json
from typing import List, Optional, Sequence

from fairseq_rope_tools.deploy.engine import Hypothesis
from fairseq_rope_tools.deploy.segmentation import desegment


def texts_per_line(results: Sequence[List[Hypothesis]], output_format: str, bpe_type: Optional[str],
                   target: Optional[str]) -> List[List[str]]:
    """Each line's hypotheses as text lines (:func:`desegment`), desegmented in one call for all
    the lines of ``results`` (the detokenizer's start-up paid once)."""
    texts = iter(desegment([h.tokens for hypotheses in results for h in hypotheses], output_format, bpe_type,
                           target))
    return [[next(texts) for _ in hypotheses] for hypotheses in results]


class OutputFormat:
    """``output_format`` (detok, tok or bpe) of ``nbest`` hypotheses per line, as plain text or JSON
    lines; ``bpe_type`` and ``target`` for removing the BPE and detokenizing."""

    def __init__(self, output_format: str, nbest: int, json_lines: bool, bpe_type: Optional[str],
                 target: Optional[str]):
        self.output_format, self.nbest, self.json_lines = output_format, nbest, json_lines
        self.bpe_type, self.target = bpe_type, target

    def lines(self, numbers: Sequence[int], results: Sequence[List[Hypothesis]],
              notes: Sequence[Optional[str]]) -> List[str]:
        """The output lines of the input lines ``numbers``, whose hypotheses are ``results``;
        ``notes``: per line, None, ``"skipped"``, ``"truncated"`` or ``"split"`` (too long)."""
        texts = texts_per_line(results, self.output_format, self.bpe_type, self.target)
        out = []
        for number, hypotheses, line_texts, note in zip(numbers, results, texts, notes):
            translated = [(text, h.score) for text, h in zip(line_texts, hypotheses)]
            if not self.json_lines:
                out += [text for text, _ in translated] + [""] * (self.nbest - len(translated))
                continue
            record = {"line": number, "translations": [{"text": text, "score": score} for text, score in translated]}
            if note == "skipped":
                record["skipped"] = "too long"
            elif note in ("truncated", "split"):
                record[note] = True
            out.append(json.dumps(record, ensure_ascii=False))
        return out

"""The seam between fairseq-rope-translate (and the benchmarks) and what decodes: an
:class:`Engine` translates a batch of token lists, says the longest source it takes, and reports
what it did. Implemented by
:class:`~fairseq_rope_tools.deploy.ctranslate2_engine.CTranslate2Engine`,
:class:`~fairseq_rope_tools.deploy.fairseq_engine.FairseqEngine` and the length-bucket router
:class:`~fairseq_rope_tools.deploy.length_buckets.LengthBuckets`; driven by
:mod:`~fairseq_rope_tools.deploy.batching`.

A new engine is a module with a subclass of :class:`Engine` and an entry in the registry of
engines (:mod:`~fairseq_rope_tools.deploy.engines`: its flags, checks, files, how it opens and
which export it reads), which fairseq-rope-translate and fairseq-rope-serve look it up in;
nothing else changes.
"""

import os
from dataclasses import dataclass
from typing import List, NamedTuple, Optional


@dataclass(frozen=True)
class Decoding:
    """Beam search as fairseq-generate in evaluate.sh runs it."""

    beam: int = 4
    lenpen: float = 0.6
    max_len: int = 200     # target tokens before </s> (fairseq-generate's --max-len-b with --max-len-a 0)
    nbest: int = 1         # hypotheses returned per source, best first (at most ``beam``)


class Hypothesis(NamedTuple):
    tokens: List[str]
    score: float           # the engine's own: log-probability normalised by length ** lenpen


class Engine:
    """Translates batches of sources (lists of the model's source tokens, without ``</s>``)."""

    name = "engine"
    #: the longest source in positions (its tokens and the ``</s>`` appended), None when unknown
    max_source: Optional[int] = None

    def translate(self, batch: List[List[str]], decoding: Optional[Decoding] = None) -> List[List[Hypothesis]]:
        """The ``nbest`` hypotheses of every source of ``batch`` (none empty), best first, in order;
        ``decoding``: another beam search than the engine was built with (a request's to
        fairseq-rope-serve), on the same loaded model; None: the engine's own."""
        raise NotImplementedError

    def group(self, source: List[str]) -> int:
        """Sources of one group go into one batch (the router: the bucket of the source's length)."""
        return 0

    def report(self) -> dict:
        """What the engine did, for --stats-json (empty: nothing beyond the decoding time)."""
        return {}

    def summary(self) -> Optional[str]:
        """:meth:`report` as one line for stderr, or None."""
        return None


def decode(engine: Engine, batch: List[List[str]], decoding: Optional[Decoding] = None) -> List[List[Hypothesis]]:
    """``engine.translate(batch)``, with ``decoding`` only when one is given: an engine that only
    decodes as it was built (a stand-in in tests) takes the batch alone."""
    return engine.translate(batch) if decoding is None else engine.translate(batch, decoding)


#: how long an OpenMP thread spins before it sleeps, for more than one thread (GNU OpenMP's default,
#: 300,000 spins, lets idle threads take the cores that busy ones need on a shared host)
GOMP_SPINCOUNT = "10000"


def limit_openmp_spinning(threads: int) -> None:
    """With more than one thread, GOMP_SPINCOUNT unless the user set it or OMP_WAIT_POLICY: read when
    the engine's OpenMP loads: an engine calls it before it imports CTranslate2 or torch."""
    if threads > 1 and "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = GOMP_SPINCOUNT

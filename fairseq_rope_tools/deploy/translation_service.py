"""What fairseq-rope-serve does with a request, apart from HTTP: the model and its segmentation,
the cheap length check, a text too long split into sentences (--too-long split, the default),
the queue's place, the text work in a thread of its own, and the answer as
fairseq-rope-translate would write it."""

import asyncio
import concurrent.futures
from typing import Callable, List, Optional, Tuple

from fairseq_rope_tools.deploy import engines
from fairseq_rope_tools.deploy.batching import certainly_too_long, fits
from fairseq_rope_tools.deploy.engine import Decoding, Engine, Hypothesis
from fairseq_rope_tools.deploy.model_setup import ModelSetup
from fairseq_rope_tools.deploy.output import texts_per_line
from fairseq_rope_tools.deploy.paragraphs import rejoined, sentence_groups, sentence_splitter
from fairseq_rope_tools.deploy.request_batcher import RequestBatcher
from fairseq_rope_tools.deploy.segmentation import Segmenter
from fairseq_rope_tools.deploy.service_requests import RequestError


class Service:
    """The model of ``setup`` (model_setup.check_model's, as fairseq-rope-serve checks it), loaded
    by :meth:`load` as its engine's entry opens it (engines.py), and what POST /translate does with
    a request. Text work (segmentation, detokenisation) runs in a thread of its own, so that no
    text, however slow to segment, holds the event loop."""

    def __init__(self, args, setup: ModelSetup):
        self.args, self.setup = args, setup
        self.engine: Optional[Engine] = None
        self.segment: Optional[Callable[[str], List[str]]] = None
        self.split = sentence_splitter(setup.src) if args.too_long == "split" else None
        self.split_texts = self.sentences_left_out = 0  # counted for /metrics
        self.batcher: Optional[RequestBatcher] = None
        self.text_work = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="text")
        self.ready = False

    def load(self) -> None:
        """The engine and the segmenter (in a thread: the server answers /health meanwhile)."""
        # a request's own beam_size and nbest are its own; requests come mixed, as a stream's lines:
        # every model used stays loaded
        decoding = Decoding(self.args.beam, self.args.lenpen, self.args.max_len, 1)
        self.engine = engines.open_engine(self.setup, self.args, decoding, keep_loaded=True)
        self.segment = Segmenter(self.setup.segmentation)

    def refuse_certainly_too_long(self, sentences: List[str]) -> None:
        """RequestError for a sentence that cannot fit whatever its segmentation: its words and
        characters counted, no tokeniser run (BPE over a 200 KB word takes seconds)."""
        for i, sentence in enumerate(sentences):
            self._refuse_if_certainly_too_long(sentence, f'"text"[{i}]')

    def _refuse_if_certainly_too_long(self, text: str, what: str) -> None:
        limit = self.engine.max_source
        if certainly_too_long(text, limit):
            raise RequestError(413, f"{what} has {len(text.split())} words and {len(text)} characters; the model "
                                    f"takes at most {limit - 1} BPE tokens (--max-source-positions): split the "
                                    "sentence")

    def sources(self, sentences: List[str]) -> Tuple[List[Optional[List[str]]], List[range]]:
        """The model's tokens of each sentence, and for each text the positions of its sources:
        one, or with --too-long split one per sentence of a text too long (None: one left out,
        --too-long-sentence skip). RequestError for a text or sentence longer than the model takes."""
        limit = self.engine.max_source
        per_input = self.args.max_sentences_per_input
        sources, pieces = [], []
        for i, sentence in enumerate(sentences):
            tokens = None if certainly_too_long(sentence, limit) else self.segment(sentence)
            fitting = tokens is not None and fits(tokens, limit)
            parts = self.split(sentence) if self.split is not None and (per_input or not fitting) else None
            if fitting and (parts is None or len(parts) <= per_input):
                text_sources = [tokens]
            elif parts is None:
                self._refuse_if_certainly_too_long(sentence, f'"text"[{i}]')
                raise RequestError(413, f'"text"[{i}] is {len(tokens)} BPE tokens long; the model takes at most '
                                        f"{limit - 1} (--max-source-positions): split the sentence")
            else:
                self.split_texts += 1
                if len(sources) + len(parts) + len(sentences) - i - 1 > self.args.max_lines:  # before any is segmented
                    raise RequestError(413, f'"text"[{i}] splits into {len(parts)} sentences: with the request\'s '
                                            f"others, more than the {self.args.max_lines} the server takes in one "
                                            "request (--max-lines): send fewer")
                text_sources = []  # --max-sentences-per-input of them at a time (else one)
                for k, text, tokens in sentence_groups(parts, per_input or 1, self.segment, limit):
                    of = f"'s sentence {k + 1}" if len(parts) > 1 else ""
                    text_sources.append(self._sentence_source(text, f'"text"[{i}]{of}') if tokens is None else tokens)
                self.sentences_left_out += text_sources.count(None)
            pieces.append(range(len(sources), len(sources) + len(text_sources)))
            sources += text_sources
        return sources, pieces

    def _sentence_source(self, sentence: str, what: str) -> Optional[List[str]]:
        """A sentence of a split text: its tokens, or None when it is too long and
        --too-long-sentence is skip (RequestError when refuse)."""
        limit = self.engine.max_source
        skip = self.args.too_long_sentence == "skip"
        if certainly_too_long(sentence, limit):
            if skip:
                return None
            self._refuse_if_certainly_too_long(sentence, what)
        tokens = self.segment(sentence)
        if fits(tokens, limit):
            return tokens
        if skip:
            return None
        raise RequestError(413, f"{what} is {len(tokens)} BPE tokens long; the model takes at most {limit - 1} "
                                "(--max-source-positions): split the sentence")

    def answer(self, results: List[List[Hypothesis]], nbest: int, scores: bool) -> dict:
        """The JSON answer: the detokenized translations (n-best lists when ``nbest`` > 1) and, when
        asked, their scores, as fairseq-rope-translate writes them (output.texts_per_line)."""
        translations, scored = [], []
        texts = texts_per_line(results, self.setup.output_format, self.setup.bpe_type, self.setup.tgt)
        for hypotheses, found in zip(results, texts):
            if nbest == 1:  # an empty sentence has no hypothesis: an empty translation
                translations.append(found[0] if found else "")
                scored.append(hypotheses[0].score if hypotheses else None)
            else:
                translations.append(found)
                scored.append([h.score for h in hypotheses])
        return {"translations": translations, "scores": scored} if scores else {"translations": translations}

    async def translate(self, sentences: List[str], beam: int, nbest: int, scores: bool) -> dict:
        """The answer to a request (:func:`read_request`); raises RequestError and QueueFull. A full
        queue refuses before any text work; the place kept is given back if the request fails or
        its client goes."""
        decoding = Decoding(beam, self.args.lenpen, self.args.max_len, nbest)
        loop = asyncio.get_running_loop()
        with self.batcher.place(len(sentences)) as place:
            if self.split is None:  # else each sentence of a text too long is checked so
                self.refuse_certainly_too_long(sentences)
            sources, pieces = await loop.run_in_executor(self.text_work, self.sources, sentences)
            kept = [source for source in sources if source is not None]
            self.batcher.resize(place, len(kept))  # a text split counts its sentences against --max-queue
            decoded = iter(await self.batcher.translate(kept, decoding, place))
            results = [next(decoded) if source is not None else [] for source in sources]
        per_text = rejoined(results, pieces, nbest)
        return await loop.run_in_executor(self.text_work, self.answer, per_text, nbest, scores)

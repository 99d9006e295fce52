"""What fairseq-rope-serve does with a request, apart from HTTP: the model and its segmentation,
the cheap length check, the queue's place, the text work in a thread of its own, and the answer
as fairseq-rope-translate would write it."""

import asyncio
import concurrent.futures
from typing import Callable, List, Optional

from fairseq_rope_tools.deploy.batching import certainly_too_long, fits
from fairseq_rope_tools.deploy.engine import Decoding, Engine, Hypothesis
from fairseq_rope_tools.deploy.model_setup import ModelSetup
from fairseq_rope_tools.deploy.output import texts_per_line
from fairseq_rope_tools.deploy.request_batcher import RequestBatcher
from fairseq_rope_tools.deploy.segmentation import Segmenter
from fairseq_rope_tools.deploy.service_requests import RequestError


class Service:
    """The model of ``setup`` (model_setup.check_model's, as fairseq-rope-serve checks it), loaded
    by :meth:`load` -- ``open_engine()`` builds its engine -- and what
    POST /translate does with a request. Text work (segmentation, detokenisation) runs in a
    thread of its own, so that no text, however slow to segment, holds the event loop."""

    def __init__(self, args, setup: ModelSetup, open_engine: Optional[Callable[[], Engine]] = None):
        self.args, self.setup = args, setup
        self.open_engine = open_engine
        self.engine: Optional[Engine] = None
        self.segment: Optional[Callable[[str], List[str]]] = None
        self.batcher: Optional[RequestBatcher] = None
        self.text_work = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="text")
        self.ready = False

    def load(self) -> None:
        """The engine and the segmenter (in a thread: the server answers /health meanwhile)."""
        self.engine = self.open_engine()
        self.segment = Segmenter(self.setup.segmentation)

    def refuse_certainly_too_long(self, sentences: List[str]) -> None:
        """RequestError for a sentence that cannot fit whatever its segmentation: its words and
        characters counted, no tokeniser run (BPE over a 200 KB word takes seconds)."""
        limit = self.engine.max_source
        for i, sentence in enumerate(sentences):
            if certainly_too_long(sentence, limit):
                raise RequestError(413, f'"text"[{i}] has {len(sentence.split())} words and {len(sentence)} '
                                        f"characters; the model takes at most {limit - 1} BPE tokens "
                                        "(--max-source-positions): split the sentence")

    def sources(self, sentences: List[str]) -> List[List[str]]:
        """The model's tokens of each sentence; RequestError for one longer than the model takes."""
        limit = self.engine.max_source
        sources = []
        for i, sentence in enumerate(sentences):
            tokens = self.segment(sentence)
            if not fits(tokens, limit):
                raise RequestError(413, f'"text"[{i}] is {len(tokens)} BPE tokens long; the model takes at most '
                                        f"{limit - 1} (--max-source-positions): split the sentence")
            sources.append(tokens)
        return sources

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
            self.refuse_certainly_too_long(sentences)
            sources = await loop.run_in_executor(self.text_work, self.sources, sentences)
            results = await self.batcher.translate(sources, decoding, place)
        return await loop.run_in_executor(self.text_work, self.answer, results, nbest, scores)

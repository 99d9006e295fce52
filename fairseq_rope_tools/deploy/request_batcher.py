"""Batching across requests, for fairseq-rope-serve: the sentences of concurrent requests are
translated together, so that many small requests decode in batches as a file does.

Requests wait in a queue bounded in sentences (a full queue refuses a request, :class:`QueueFull`,
instead of growing without bound). A batch leaves when the queue holds ``max_batch`` sentences
of one beam-search setting, or ``max_wait`` seconds after its oldest request came, whichever is
first; it takes whole requests of that setting in order of arrival (one request larger than
``max_batch`` goes alone, in several engine batches). One batch decodes at a time, in a thread
(CTranslate2 releases the GIL, so the event loop meanwhile reads, checks and segments the next
requests), through :func:`~fairseq_rope_tools.deploy.batching.translate_sorted`, the sorting by
length that fairseq-rope-translate decodes a file with.

Standard library and the deploy seam only: asyncio, no web framework.
"""

import asyncio
import collections
import contextlib
from dataclasses import dataclass
from typing import Callable, Deque, List, Optional

from fairseq_rope_tools.deploy.batching import translate_sorted
from fairseq_rope_tools.deploy.engine import Decoding, Engine, Hypothesis


class QueueFull(Exception):
    """The queue cannot take the request's sentences: ``waiting`` sentences wait already, and it
    holds at most ``limit``."""

    def __init__(self, waiting: int, limit: int):
        super().__init__(f"{waiting} sentences are waiting; the queue holds at most {limit}")
        self.waiting, self.limit = waiting, limit


@dataclass
class Place:
    """Sentences counted in a queue before they join it (:meth:`RequestBatcher.place`)."""

    sentences: int


@dataclass
class _Request:
    sources: List[List[str]]
    decoding: Decoding
    future: asyncio.Future
    arrived: float  # the event loop's clock


class RequestBatcher:
    """Translates the requests given to :meth:`translate` with ``engine``, in batches of at most
    ``max_batch`` sentences, waiting at most ``max_wait`` seconds for a batch to fill, with at most
    ``max_queue`` sentences waiting; decodes in ``executor``. :meth:`run` is the task that forms
    and decodes the batches."""

    def __init__(self, engine: Engine, max_batch: int, max_wait: float, max_queue: int, executor,
                 on_batch: Optional[Callable[[int, float], None]] = None):
        self.engine, self.executor, self.on_batch = engine, executor, on_batch
        self.max_batch, self.max_wait, self.max_queue = max_batch, max_wait, max_queue
        self.pending: Deque[_Request] = collections.deque()
        self.waiting = 0                  # sentences queued or with a place kept, not yet in a batch
        self.batches = self.sentences = 0  # decoded so far
        self._arrived = None              # an asyncio.Event, made by run() in its loop

    @contextlib.contextmanager
    def place(self, sentences: int):
        """A place in the queue for ``sentences`` sentences, kept while the request is read and
        segmented (so that a full queue refuses it before that work): raises :class:`QueueFull` at
        once when the queue cannot take them; given back when the block ends without
        :meth:`translate` having taken it (a refusal, a client gone)."""
        if self.waiting + sentences > self.max_queue:
            raise QueueFull(self.waiting, self.max_queue)
        self.waiting += sentences
        kept = Place(sentences)
        try:
            yield kept
        finally:
            self.waiting -= kept.sentences

    def resize(self, place: Place, sentences: int) -> None:
        """The place now holds ``sentences`` sentences (a text split into its sentences): raises
        :class:`QueueFull` when the queue cannot take the more."""
        more = sentences - place.sentences
        if more > 0 and self.waiting + more > self.max_queue:
            raise QueueFull(self.waiting, self.max_queue)
        self.waiting += more
        place.sentences = sentences

    async def translate(self, sources: List[List[str]], decoding: Decoding,
                        place: Optional[Place] = None) -> List[List[Hypothesis]]:
        """The hypotheses of ``sources`` (an empty one gets none), decoded with ``decoding``, in
        order; raises :class:`QueueFull` at once when the queue cannot take them, unless they
        have a ``place`` (:meth:`place`) already."""
        if place is None:
            if self.waiting + len(sources) > self.max_queue:
                raise QueueFull(self.waiting, self.max_queue)
            self.waiting += len(sources)
        else:
            assert place.sentences == len(sources)
            place.sentences = 0  # the queue holds them now: counted until they leave in a batch
        loop = asyncio.get_running_loop()
        request = _Request(sources, decoding, loop.create_future(), loop.time())
        self.pending.append(request)
        self._arrived.set()
        try:
            return await request.future
        except asyncio.CancelledError:  # its client went away: if it still waits, it leaves the queue now
            if any(r is request for r in self.pending):
                self.pending = collections.deque(r for r in self.pending if r is not request)
                self.waiting -= len(sources)
            raise

    async def run(self) -> None:
        """Form and decode batches, one at a time, until cancelled; a batch whose decoding fails
        fails its requests, and the next batch is decoded as usual."""
        loop = asyncio.get_running_loop()
        self._arrived = asyncio.Event()
        while True:
            await self._batch_ready(loop)
            batch = self._take()
            if not batch:
                continue
            sources = [source for request in batch for source in request.sources]
            try:
                results, seconds = await loop.run_in_executor(self.executor, translate_sorted, self.engine, sources,
                                                              self.max_batch, False, batch[0].decoding)
            except Exception as error:  # noqa: BLE001 - the requests' answer: the server goes on
                for request in batch:
                    if not request.future.done():
                        request.future.set_exception(error)
                continue
            self.batches += 1
            self.sentences += len(sources)
            if self.on_batch is not None:
                self.on_batch(len(sources), seconds)
            start = 0
            for request in batch:
                if not request.future.done():  # its client may have gone
                    request.future.set_result(results[start:start + len(request.sources)])
                start += len(request.sources)

    def _ready_sentences(self, decoding: Decoding) -> int:
        return sum(len(r.sources) for r in self.pending if r.decoding == decoding)

    async def _batch_ready(self, loop) -> None:
        """Until a batch can leave: the queue holds ``max_batch`` sentences of the oldest request's
        setting, or ``max_wait`` has passed since that request came."""
        while True:
            self._arrived.clear()
            if not self.pending:
                await self._arrived.wait()
                continue
            oldest = self.pending[0]
            left = oldest.arrived + self.max_wait - loop.time()
            if left <= 0 or self._ready_sentences(oldest.decoding) >= self.max_batch:
                return
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except asyncio.TimeoutError:
                pass

    def _take(self) -> List[_Request]:
        """The requests of the next batch, out of the queue: the oldest request, and those after
        it of its setting that fit within ``max_batch`` sentences."""
        taken: List[_Request] = []
        kept: Deque[_Request] = collections.deque()
        count = 0
        decoding = self.pending[0].decoding
        for request in self.pending:
            if request.decoding == decoding and (not taken or count + len(request.sources) <= self.max_batch):
                taken.append(request)
                count += len(request.sources)
                self.waiting -= len(request.sources)
            else:
                kept.append(request)
        self.pending = kept
        return taken

#!/usr/bin/env python3
"""A translation service over a bundle: an HTTP JSON API that translates as fairseq-rope-translate.

    fairseq-rope-serve --model-dir ct2/wmt14_en_de [--host 127.0.0.1] [--port 8080]
    curl -s localhost:8080/translate -d '{"text": ["Hello world.", "How are you?"]}'
    {"translations": ["Hallo Welt.", "Wie geht es dir?"]}

``POST /translate`` takes ``{"text": ["raw sentence", ...]}`` and optionally ``"beam_size"`` (the
flags' --beam unless given; at most --max-beam), ``"nbest"`` (1; at most the beam size) and
``"scores": true``; it answers ``{"translations": ["...", ...]}`` in order, a list of n-best lists
when ``nbest`` > 1, and ``"scores"`` of the same shape when asked (the engine's scores, as
fairseq-rope-translate --json-lines gives them). Each sentence goes through the bundle's
segmentation, the model and the detokenizer exactly as fairseq-rope-translate --model-dir BUNDLE
--beam B --nbest N takes a line of a file: the same code (fairseq_rope_tools/deploy/), the same
translations. An empty sentence gets an empty translation. ``GET /health`` answers as soon as
the server listens; ``GET /ready`` answers 200 only once the model is loaded (503 before), with
the queue's counters.

Concurrent requests are translated together: their sentences wait in a queue and leave in
batches of at most --max-batch-size sentences, at most --max-batch-wait seconds after the oldest
came (fairseq_rope_tools/deploy/request_batcher.py). A request the server cannot take is answered
at once with a 4xx and a one-line JSON ``{"error": "..."}`` naming the problem -- a body that is
not UTF-8 or not JSON, a field of the wrong type, an unknown field, a line break inside a
sentence, more than --max-lines sentences, a sentence longer than the model takes, a body over
--max-body-bytes -- and one that would overfill the queue (--max-queue sentences waiting) with
503 and Retry-After; the server goes on serving.

SIGTERM (or Ctrl-C) stops accepting connections, finishes the requests in flight (at most
--shutdown-timeout seconds), then exits 0; a second one stops at once, and the server exits 1
naming the requests left unanswered. Each request gets one access line on stderr: client,
method, path, status, sentences and milliseconds (an internal error adds its traceback).

Needs aiohttp: ``pip install 'fairseq-rope[serve]'`` (make setup installs it). CTranslate2 on
cpu or cuda, single exports and length buckets (every bucket kept loaded); the flags that choose
the model and its beam search are fairseq-rope-translate's.
"""

import argparse
import asyncio
import concurrent.futures
import functools
import json
import signal
import threading
import time
import traceback
from typing import Callable, List, Optional

from fairseq_rope_tools.cli import ArgumentParser, UserError, command, sayer
from fairseq_rope_tools.deploy import translate
from fairseq_rope_tools.deploy.batching import fits
from fairseq_rope_tools.deploy.engine import Decoding, Engine, Hypothesis
from fairseq_rope_tools.deploy.output import texts_per_line
from fairseq_rope_tools.deploy.request_batcher import QueueFull, RequestBatcher
from fairseq_rope_tools.deploy.segmentation import Segmenter, first_line
from fairseq_rope_tools.text_lines import LINE_BREAKS

try:
    from aiohttp import web

    # the sentences of a POST /translate, for its access line: a typed key from aiohttp 3.14 on (which
    # warns about a plain string), a string before
    LINES = web.RequestKey("lines", int) if hasattr(web, "RequestKey") else "lines"
except ImportError:  # the serve extra is not installed: main says how to install it
    web = None

say = sayer("serve")

#: the fields of a request to POST /translate
FIELDS = ("text", "beam_size", "nbest", "scores")
LINE_BREAK_CHARACTERS = "\n" + LINE_BREAKS


def parse_args(argv):
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (127.0.0.1: this machine only; "
                                                       "0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8080, help="the port to listen on (8080; 0: any free port, printed)")
    translate.add_model_arguments(p)
    p.add_argument("--max-beam", type=int, default=8, help="the largest beam_size a request may ask for (8)")
    p.add_argument("--max-batch-size", type=int, default=64,
                   help="sentences decoded together, from one request or several (64, as fairseq-rope-translate's "
                        "--batch-size)")
    p.add_argument("--max-batch-wait", type=float, default=0.005, metavar="SECONDS",
                   help="how long a batch waits for more requests once its first has come (0.005)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="sentences that may wait for a batch; a request beyond is answered 503 (1024)")
    p.add_argument("--max-lines", type=int, help="sentences in one request (256, or --max-queue if smaller)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="bytes in one request body (1048576)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long to wait for the requests in flight (30; a second SIGTERM stops "
                        "at once)")
    args = p.parse_args(argv)
    if args.max_lines is None:
        args.max_lines = min(256, args.max_queue)
    translate.check_model_arguments(p, args, (("max_beam", 1), ("max_batch_size", 1), ("max_queue", 1),
                                              ("max_lines", 1), ("max_body_bytes", 1)))
    if args.beam > args.max_beam:
        p.error(f"--beam {args.beam}: the default beam size must be at most --max-beam {args.max_beam}")
    if args.max_lines > args.max_queue:  # such a request could never be queued: a 503 that never clears
        p.error(f"--max-lines {args.max_lines} must be at most --max-queue {args.max_queue}")
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be from 0 to 65535, not {args.port}")
    for flag in ("max_batch_wait", "shutdown_timeout"):
        if not 0 <= getattr(args, flag) < float("inf"):
            p.error(f"--{flag.replace('_', '-')} must be a number of seconds >= 0, not {getattr(args, flag)}")
    args.decoding = Decoding(args.beam, args.lenpen, args.max_len, 1)  # a request's own beam_size, nbest: its own
    return args


def check_model(args):
    """The model and its segmentation as fairseq-rope-translate checks them for raw text from
    a file (translate.check_model): a bundle verified against its manifest, the languages, the
    vocabularies. Raises UserError."""
    args.engine, args.checkpoint, args.input_format, args.output_format = "ctranslate2", None, "raw", None
    if not args.model_dir:
        raise UserError("give --model-dir: a bundle written by fairseq-rope-export")
    translate.check_model(args)
    args.streaming = True  # requests come mixed, as a stream's lines: every bucket used stays loaded


# --- a request, read and checked -----------------------------------------------------------------
class RequestError(Exception):
    """What is wrong with a request, as its answer: an HTTP status and one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def json_kind(value) -> str:
    """A JSON value's kind, for a message: ``a string``, ``a number``, ..."""
    if isinstance(value, bool):
        return "true" if value else "false"
    kinds = ((str, "a string"), (int, "a number"), (float, "a number"), (list, "a list"), (dict, "an object"))
    return next((kind for cls, kind in kinds if isinstance(value, cls)), "null")


def count_field(data: dict, name: str, default: int, largest: int, bound: str) -> int:
    """The integer field ``name`` of a request (``default`` when absent), from 1 to ``largest``."""
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= largest:
        raise RequestError(400, f'"{name}" must be an integer from 1 to {largest} ({bound}), not '
                                f'{json.dumps(value, ensure_ascii=False)[:40]}')
    return value


def read_request(body: bytes, default_beam: int, max_beam: int, max_lines: int):
    """(sentences, beam size, nbest, scores) of a POST /translate body; RequestError if it is not
    a request the server takes."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"the request body is not UTF-8: byte 0x{body[e.start]:02x} at offset {e.start}; "
                                "send JSON in UTF-8") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        where = f" at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else ""
        raise RequestError(400, f"the request body is not JSON ({getattr(e, 'msg', e)}{where}): send "
                                '{"text": ["a sentence", ...]}') from None
    if not isinstance(data, dict):
        raise RequestError(400, f'the request body is {json_kind(data)}, not a JSON object: send '
                                '{"text": ["a sentence", ...]}')
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise RequestError(400, f'unknown field "{unknown[0]}": a request has {", ".join(FIELDS)}')
    if "text" not in data:
        raise RequestError(400, 'the request has no "text": send {"text": ["a sentence", ...]}')
    sentences = data["text"]
    if not isinstance(sentences, list):
        raise RequestError(400, f'"text" must be a list of strings, not {json_kind(sentences)}: send '
                                '{"text": ["a sentence", ...]}')
    if len(sentences) > max_lines:
        raise RequestError(413, f"{len(sentences)} sentences in one request; the server takes at most {max_lines} "
                                "(--max-lines): split the request")
    for i, sentence in enumerate(sentences):
        if not isinstance(sentence, str):
            raise RequestError(400, f'"text"[{i}] must be a string, not {json_kind(sentence)}')
        brk = next((c for c in sentence if c in LINE_BREAK_CHARACTERS), None)
        if brk is not None:
            raise RequestError(400, f'"text"[{i}] holds a line break (U+{ord(brk):04X}): send each sentence as an '
                                    "item of its own")
        try:
            sentence.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(400, f'"text"[{i}] holds an unpaired surrogate (\\u{ord(sentence[e.start]):04x}), '
                                    "which is no character: send valid Unicode") from None
    beam = count_field(data, "beam_size", default_beam, max_beam, "--max-beam")
    nbest = count_field(data, "nbest", 1, beam, "the beam size")
    scores = data.get("scores", False)
    if not isinstance(scores, bool):
        raise RequestError(400, f'"scores" must be true or false, not {json_kind(scores)}')
    return sentences, beam, nbest, scores


# --- the service: the model, its segmentation and the queue ---------------------------------------
class Service:
    """The model of ``args`` (checked by :func:`check_model`), loaded by :meth:`load` --
    ``open_engine()`` builds its engine (default: fairseq-rope-translate's) -- and what
    POST /translate does with a request."""

    def __init__(self, args, open_engine: Optional[Callable[[], Engine]] = None):
        self.args = args
        self.open_engine = open_engine or functools.partial(translate.open_ctranslate2, args)
        self.engine: Optional[Engine] = None
        self.segment: Optional[Callable[[str], List[str]]] = None
        self.batcher: Optional[RequestBatcher] = None
        self.ready = False

    def load(self) -> None:
        """The engine and the segmenter (in a thread: the server answers /health meanwhile)."""
        self.engine = self.open_engine()
        self.segment = Segmenter(self.args.segmentation)

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
        texts = texts_per_line(results, self.args.output_format, self.args.bpe_type, self.args.tgt)
        for hypotheses, found in zip(results, texts):
            if nbest == 1:  # an empty sentence has no hypothesis: an empty translation
                translations.append(found[0] if found else "")
                scored.append(hypotheses[0].score if hypotheses else None)
            else:
                translations.append(found)
                scored.append([h.score for h in hypotheses])
        return {"translations": translations, "scores": scored} if scores else {"translations": translations}

    async def translate(self, sentences: List[str], beam: int, nbest: int, scores: bool) -> dict:
        """The answer to a request (:func:`read_request`); raises RequestError and QueueFull."""
        decoding = Decoding(beam, self.args.lenpen, self.args.max_len, nbest)
        results = await self.batcher.translate(self.sources(sentences), decoding)
        return self.answer(results, nbest, scores)


# --- HTTP ------------------------------------------------------------------------------------------
def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def error_response(status: int, message: str, retry_after: Optional[int] = None):
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response({"error": message}, status=status, headers=headers, dumps=_dumps)


class Server:
    """The HTTP server of a :class:`Service`: :meth:`run` listens, loads the model, serves until
    :meth:`stop` (SIGTERM, SIGINT), then finishes the requests in flight. ``port`` is the one it
    listens on once ``listening`` is set."""

    def __init__(self, service: Service, host: str, port: int, shutdown_timeout: float):
        self.service, self.host, self.port, self.shutdown_timeout = service, host, port, shutdown_timeout
        args = service.args
        self.max_body = args.max_body_bytes
        self.listening = threading.Event()
        self.in_flight = self.requests = 0
        self.stopping = False
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._stop_now: Optional[asyncio.Event] = None

    def stop(self) -> None:
        """Stop as SIGTERM does, a second call as a second SIGTERM; from any thread."""
        self.listening.wait()
        self.loop.call_soon_threadsafe(self._on_stop_signal)

    def _on_stop_signal(self) -> None:
        if self._stop.is_set():  # a second signal: whoever sends it will not wait for the drain
            self._stop_now.set()
        self._stop.set()

    # the routes
    async def health(self, request):
        return web.json_response({"status": "alive"})

    async def ready(self, request):
        batcher = self.service.batcher
        state = {"ready": self.service.ready and not self.stopping}
        if batcher is not None:
            state.update(waiting=batcher.waiting, batches=batcher.batches, sentences=batcher.sentences)
        return web.json_response(state, status=200 if state["ready"] else 503)

    async def translate(self, request):
        if not self.service.ready:
            return error_response(503, "the model is still loading: retry once GET /ready answers 200", retry_after=1)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"the request body is over {self.max_body} bytes (--max-body-bytes): send "
                                       "fewer sentences per request")
        args = self.service.args
        try:
            sentences, beam, nbest, scores = read_request(body, args.beam, args.max_beam, args.max_lines)
            request[LINES] = len(sentences)
            answer = await self.service.translate(sentences, beam, nbest, scores)
        except RequestError as e:
            return error_response(e.status, str(e))
        except QueueFull as e:
            return error_response(503, f"the server is busy: {e}: retry later", retry_after=1)
        return web.json_response(answer, dumps=_dumps)

    async def access(self, request, handler):
        """One access line per request; aiohttp's own refusals (no such path, method) as JSON; and,
        once stopping, no new request on a connection kept alive."""
        started = time.perf_counter()
        self.in_flight += 1
        try:
            if self.stopping:
                response = error_response(503, "the server is shutting down: retry with another instance",
                                          retry_after=1)
                response.force_close()
            else:
                response = await handler(request)
        except web.HTTPException as e:
            response = error_response(e.status, f"{request.method} {request.path}: {e.reason}"
                                                + ("" if e.status != 404 else ": the routes are GET /health, "
                                                   "GET /ready and POST /translate"))
        except Exception as e:  # noqa: BLE001 - one request failed; the server goes on
            say(f'internal error on "{request.method} {request.path}":\n{traceback.format_exc().rstrip()}')
            response = error_response(500, f"internal error: {first_line(e)}")
        finally:
            self.in_flight -= 1
            self.requests += 1
        say(f'{request.remote} "{request.method} {request.path}" {response.status} lines={request.get(LINES, "-")} '
            f"ms={(time.perf_counter() - started) * 1000:.1f}")
        return response

    async def run(self) -> None:
        """Listen, load the model, serve until stopped, finish the requests in flight. Raises
        UserError when it cannot listen or load the model, or the requests in flight outlast
        --shutdown-timeout."""
        self.loop = asyncio.get_running_loop()
        self._stop, self._stop_now = asyncio.Event(), asyncio.Event()

        @web.middleware
        async def access(request, handler):
            return await self.access(request, handler)

        app = web.Application(client_max_size=self.max_body, middlewares=[access])
        app.add_routes([web.get("/health", self.health), web.get("/ready", self.ready),
                        web.post("/translate", self.translate)])
        # its shutdown_timeout: for the answers still being written once the requests in flight are done
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")
        previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
        for signum in previous:
            self.loop.add_signal_handler(signum, self._on_stop_signal)
        batcher_task = None
        try:
            batcher_task = await self._serve(runner, executor)
        finally:
            unanswered = self.in_flight
            await runner.cleanup()
            if batcher_task is not None:
                batcher_task.cancel()
            executor.shutdown(wait=False)
            for signum, handler in previous.items():  # asyncio leaves the default action, not the one before
                self.loop.remove_signal_handler(signum)
                signal.signal(signum, handler)
        if unanswered:
            after = ("a second SIGTERM or SIGINT" if self._stop_now.is_set()
                     else f"--shutdown-timeout {self.shutdown_timeout:g} s")
            raise UserError(f"{unanswered} request{'s' if unanswered != 1 else ''} still in flight after {after}: "
                            "stopped without answering them", status=1)
        batcher = self.service.batcher
        say(f"stopped: {self.requests} requests" + (f", {batcher.sentences} sentences in {batcher.batches} batches"
                                                     if batcher else ""))

    async def _serve(self, runner, executor):
        """Listen, load, serve until stopped, then wait (at most --shutdown-timeout) for the
        requests in flight; the batcher's task, or None when stopped before the model loaded."""
        args = self.service.args
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
        except OSError as e:
            raise UserError(f"--host {self.host} --port {self.port}: cannot listen there ({e.strerror or e}): give "
                            "another --port (0: any free one)") from None
        self.port = runner.addresses[0][1]
        self.listening.set()
        shown = f"[{self.host}]" if ":" in self.host else self.host
        say(f"listening on http://{shown}:{self.port} (GET /health, GET /ready, POST /translate); loading the model")
        loading = self.loop.run_in_executor(executor, self.service.load)
        stopped = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait([loading, stopped], return_when=asyncio.FIRST_COMPLETED)
        batcher_task = None
        if loading.done():
            loading.result()  # a model that cannot load: its UserError
            self.service.batcher = RequestBatcher(self.service.engine, args.max_batch_size, args.max_batch_wait,
                                                  args.max_queue, executor)
            batcher_task = asyncio.ensure_future(self.service.batcher.run())
            await asyncio.sleep(0)  # the batcher's loop runs before the first request comes
            self.service.ready = True
            say(f"ready: --model-dir {args.model_dir} (ctranslate2 on {args.device}, {args.threads} thread"
                f"{'s' if args.threads != 1 else ''}, beam {args.beam}); batches of at most {args.max_batch_size} "
                f"sentences, waiting at most {args.max_batch_wait * 1000:g} ms")
            await stopped
        self.stopping = True
        await site.stop()  # no new connections
        say(f"stopping: no new connections; finishing {self.in_flight} request{'s' if self.in_flight != 1 else ''} "
            "in flight")
        deadline = self.loop.time() + self.shutdown_timeout
        while self.in_flight and self.loop.time() < deadline and not self._stop_now.is_set():
            await asyncio.sleep(0.01)
        return batcher_task


@command
def main(argv=None):
    args = parse_args(argv)
    if web is None:
        raise UserError("fairseq-rope-serve needs aiohttp, which is not installed: pip install 'fairseq-rope[serve]' "
                        "(or run make setup)")
    check_model(args)
    asyncio.run(Server(Service(args), args.host, args.port, args.shutdown_timeout).run())


if __name__ == "__main__":
    main()

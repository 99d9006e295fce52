#!/usr/bin/env python3
"""A translation service over a bundle: an HTTP JSON API that translates as fairseq-rope-translate.

    fairseq-rope-serve --model-dir ct2/wmt14_en_de [--host 127.0.0.1] [--port 8080]
    curl -s localhost:8080/translate -H 'Content-Type: application/json' -d '{"text": ["Hello world."]}'
    {"translations": ["Hallo Welt."]}

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
at once with a 4xx (503 and Retry-After for a full queue, decided before any text is segmented)
and a one-line JSON ``{"error": "..."}`` naming the problem (docs/deploy.md lists them); the
server goes on serving. A text longer than the model takes is split into sentences, translated
and joined back (--too-long split, the default; --too-long refuse: 413; with
--max-sentences-per-input N, any text of more than N sentences, N at a time). Segmentation and
detokenisation run in a thread of their own, decoding in another: the event loop only reads and
answers. --max-connections, --head-timeout, --body-timeout and --keepalive-timeout bound what a
client holds; a client that goes away is logged as such, and its sentences leave the queue.
``GET /metrics``: Prometheus' text format (service_metrics.py).

SIGTERM (or Ctrl-C) stops accepting connections, finishes the requests in flight (at most
--shutdown-timeout seconds), then exits 0; a second one stops at once, and the server exits 1
naming the requests left unanswered. Each request gets one access line on stderr: client,
method, path (as sent, control characters escaped), status, sentences and milliseconds (an
internal error adds its traceback).

Needs aiohttp and prometheus-client: ``pip install 'fairseq-rope[serve]'`` (make setup installs
them). The engines that read a bundle (--engine; by default the one its bundle.json declares):
CTranslate2 on cpu or cuda, single exports and length buckets with every bucket kept loaded, and
ONNX Runtime (--format onnx exports); the flags that choose the model and its beam search are
fairseq-rope-translate's.
"""

import argparse
import asyncio
import concurrent.futures
import functools
import importlib.util
import json
import resource
import signal
import threading
import time
import traceback
from typing import Optional

from fairseq_rope_tools.cli import ArgumentParser, UserError, command, sayer
from fairseq_rope_tools.deploy import engines, model_setup
from fairseq_rope_tools.deploy.batching import add_too_long_arguments
from fairseq_rope_tools.deploy.paragraphs import add_sentences_per_input_argument, check_sentences_per_input
from fairseq_rope_tools.deploy.request_batcher import QueueFull, RequestBatcher
from fairseq_rope_tools.deploy.segmentation import first_line
from fairseq_rope_tools.deploy.service_requests import RequestError, read_request, shown
from fairseq_rope_tools.deploy.translation_service import Service

try:
    from aiohttp import web

    from fairseq_rope_tools.deploy.service_connections import SERVER_NAME, ConnectionGuard, json_error
    from fairseq_rope_tools.deploy.service_metrics import ServiceMetrics

    # the sentences of a POST /translate, for its access line: a typed key from aiohttp 3.14 on (which
    # warns about a plain string), a string before
    LINES = web.RequestKey("lines", int) if hasattr(web, "RequestKey") else "lines"
except ImportError:  # the serve extra is not installed: main says how to install it
    web = None

say = sayer("serve")
#: the serve extra's packages, by their module
SERVE_EXTRA = {"aiohttp": "aiohttp", "prometheus-client": "prometheus_client"}
#: file descriptors kept for the model, the log and the listening socket beside the connections
RESERVED_DESCRIPTORS = 64
#: how long a connection answered before its body was read (413, 408) still takes what the client
#: sends, so that the client reads the answer rather than a reset connection (aiohttp's default: 10)
LINGERING_SECONDS = 1.0


def parse_args(argv):
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (127.0.0.1: this machine only; "
                                                       "0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8080, help="the port to listen on (8080; 0: any free port, printed)")
    model_setup.add_model_arguments(p, engines.served_engines())  # those that read a bundle
    add_too_long_arguments(p, ("refuse", "split"), "split", ("refuse", "skip"), refusal="413")
    add_sentences_per_input_argument(p, "text")
    p.add_argument("--max-beam", type=int, default=8, help="the largest beam_size a request may ask for (8)")
    p.add_argument("--max-batch-size", type=int, default=64,
                   help="sentences decoded together, from one request or several (64, as fairseq-rope-translate's "
                        "--batch-size)")
    p.add_argument("--max-batch-wait", type=float, default=0.0, metavar="SECONDS",
                   help="how long a batch waits for more requests once its first has come (0: none; those "
                        "that come while a batch decodes form the next)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="sentences that may wait for a batch; a request beyond is answered 503 (1024)")
    p.add_argument("--max-lines", type=int, help="sentences in one request (256, or --max-queue if smaller)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="bytes in one request body (1048576)")
    p.add_argument("--max-connections", type=int,
                   help="client connections open at once; one more is answered 503 and closed (256, or what "
                        "ulimit -n leaves if less)")
    p.add_argument("--head-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a new connection's request line and headers must come within this (10)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request's body must come within this once its headers have (30)")
    p.add_argument("--keepalive-timeout", type=float, default=15.0, metavar="SECONDS",
                   help="an idle connection is closed this long after its last answer (15)")
    p.add_argument("--allowed-hosts", metavar="HOST,...",
                   help="answer only requests whose Host header (without its port) is one of these (default: any)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long to wait for the requests in flight (30; a second SIGTERM stops "
                        "at once)")
    args = p.parse_args(argv)
    if args.max_lines is None:
        args.max_lines = min(256, args.max_queue)
    descriptors = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    room = None if descriptors == resource.RLIM_INFINITY else max(1, descriptors - RESERVED_DESCRIPTORS)
    given_connections = args.max_connections is not None
    if not given_connections:
        args.max_connections = min(256, room or 256)
    model_setup.check_model_arguments(p, args, (("max_beam", 1), ("max_batch_size", 1), ("max_queue", 1),
                                              ("max_lines", 1), ("max_body_bytes", 1), ("max_connections", 1)))
    if args.beam > args.max_beam:
        p.error(f"--beam {args.beam}: the default beam size must be at most --max-beam {args.max_beam}")
    check_sentences_per_input(p, args)
    if args.max_lines > args.max_queue:  # such a request could never be queued: a 503 that never clears
        p.error(f"--max-lines {args.max_lines} must be at most --max-queue {args.max_queue}")
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be from 0 to 65535, not {args.port}")
    for flag in ("max_batch_wait", "shutdown_timeout"):
        if not 0 <= getattr(args, flag) < float("inf"):
            p.error(f"--{flag.replace('_', '-')} must be a number of seconds >= 0, not {getattr(args, flag)}")
    for flag in ("head_timeout", "body_timeout", "keepalive_timeout"):
        if not 0 < getattr(args, flag) < float("inf"):
            p.error(f"--{flag.replace('_', '-')} must be a number of seconds > 0, not {getattr(args, flag)}")
    if given_connections and room is not None and args.max_connections > room:
        p.error(f"--max-connections {args.max_connections}: this process may open {descriptors} files (ulimit -n), "
                f"{RESERVED_DESCRIPTORS} of them kept for the model and the log: give at most {room}, or raise "
                "ulimit -n")
    hosts = [h.strip().lower() for h in (args.allowed_hosts or "").split(",") if h.strip()]
    if args.allowed_hosts is not None and not hosts:
        p.error("--allowed-hosts: give host names separated by commas, e.g. --allowed-hosts localhost,mt.example.org")
    args.allowed_hosts = hosts or None
    return args


# --- HTTP ------------------------------------------------------------------------------------------
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
        self.guard: Optional[ConnectionGuard] = None
        self.metrics = ServiceMetrics(args.max_batch_size, self._counts)
        self._stop: Optional[asyncio.Event] = None
        self._stop_now: Optional[asyncio.Event] = None

    def _counts(self) -> dict:
        """What /metrics reads when scraped (service_metrics.COUNTS)."""
        guard, service = self.guard, self.service
        return dict(waiting=getattr(service.batcher, "waiting", 0), open=guard.open if guard else 0,
                    refused=guard.refused if guard else 0, timed_out=guard.timed_out if guard else 0,
                    split_texts=service.split_texts, sentences_left_out=service.sentences_left_out)

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

    async def metrics_text(self, request):
        return web.Response(body=self.metrics.text(), headers={"Content-Type": self.metrics.content_type})

    async def translate(self, request):
        if not self.service.ready:
            return json_error(503, "the model is still loading: retry once GET /ready answers 200", retry_after=1)
        if request.content_type != "application/json":  # also what makes a cross-site form post need CORS
            return json_error(415, f"the request's Content-Type is {shown(request.content_type or 'missing')}: send "
                                   "JSON with Content-Type: application/json")
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding != "identity":
            return json_error(415, f"Content-Encoding {shown(encoding)}: send the body uncompressed")
        too_big = (f"the request body is over {self.max_body} bytes (--max-body-bytes): send fewer sentences per "
                   "request")
        if request.content_length is not None and request.content_length > self.max_body:
            return self._closing(json_error(413, too_big))  # said at once: the body is never read
        args = self.service.args
        try:
            body = await asyncio.wait_for(request.read(), args.body_timeout)
        except web.HTTPRequestEntityTooLarge:
            return self._closing(json_error(413, too_big))
        except asyncio.TimeoutError:
            return self._closing(json_error(408, f"the request body did not come within {args.body_timeout:g} s "
                                                 "(--body-timeout): send it at once"))
        try:
            sentences, beam, nbest, scores = read_request(body, args.beam, args.max_beam, args.max_lines)
            request[LINES] = len(sentences)
            answer = await self.service.translate(sentences, beam, nbest, scores)
        except RequestError as e:
            return json_error(e.status, str(e))
        except QueueFull as e:
            return json_error(503, f"the server is busy: {e}: retry later", retry_after=1)
        return web.json_response(answer, dumps=functools.partial(json.dumps, ensure_ascii=False))

    @staticmethod
    def _closing(response):
        response.force_close()  # what is left of the body is not read
        return response

    async def access(self, request, handler):
        """One access line per request; aiohttp's own refusals (no such path, method) as JSON; and,
        once stopping, no new request on a connection kept alive."""
        started = time.perf_counter()
        started_request = getattr(request.protocol, "request_started", None)
        if started_request is not None:
            started_request()
        self.in_flight += 1
        hosts = self.service.args.allowed_hosts
        host = (request.host or "").rsplit(":", 1)[0].strip("[]").lower() if request.host else ""
        status, where = 500, f'"{request.method} {shown(request.raw_path, 200)}"'
        try:
            if self.stopping:
                response = json_error(503, "the server is shutting down: retry with another instance", retry_after=1)
                response.force_close()
            elif hosts is not None and host not in hosts:
                response = json_error(421, f"Host {shown(request.host or 'missing')} is not one this server answers "
                                           "(--allowed-hosts)")
            else:
                response = await handler(request)
        except web.HTTPException as e:
            response = json_error(e.status, f"{request.method} {shown(request.path, 200)}: {e.reason}"
                                            + ("" if e.status != 404 else ": the routes are GET /health, "
                                               "GET /ready, GET /metrics and POST /translate"))
        except (asyncio.CancelledError, ConnectionError) as e:  # the client went away: its work is dropped
            status = "gone"
            say(f"{request.remote} {where} client gone after ms={(time.perf_counter() - started) * 1000:.1f}")
            if isinstance(e, asyncio.CancelledError):
                raise
            response = None
        except Exception as e:  # noqa: BLE001 - one request failed; the server goes on
            say(f"internal error on {where}:\n{traceback.format_exc().rstrip()}")
            response = json_error(500, f"internal error: {first_line(e)}")
        finally:
            self.in_flight -= 1
            self.requests += 1
            self.metrics.answered(request.path if request.path in ROUTES else "other",
                                  response.status if status != "gone" else 499, time.perf_counter() - started)
        if response is None:
            raise ConnectionResetError("the client went away")
        say(f'{request.remote} {where} {response.status} lines={request.get(LINES, "-")} '
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

        async def server_name(request, response):
            response.headers["Server"] = SERVER_NAME  # no versions of what runs the service

        app = web.Application(client_max_size=self.max_body, middlewares=[access])
        app.on_response_prepare.append(server_name)
        app.add_routes([web.get("/health", self.health), web.get("/ready", self.ready),
                        web.get("/metrics", self.metrics_text), web.post("/translate", self.translate)])
        # its shutdown_timeout: for the answers still being written once the requests in flight are done;
        # handler_cancellation: a request whose client went away stops where it waits
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0,
                               handler_cancellation=True)
        await runner.setup()
        args = self.service.args
        self.guard = ConnectionGuard(runner.server, say, args.max_connections, args.head_timeout,
                                     keepalive_timeout=args.keepalive_timeout, lingering_time=LINGERING_SECONDS,
                                     access_log=None, auto_decompress=False)
        self.guard.loop = self.loop
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")
        previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
        for signum in previous:
            self.loop.add_signal_handler(signum, self._on_stop_signal)
        batcher_task = None
        try:
            batcher_task = await self._serve(executor)
        finally:
            unanswered = self.in_flight
            await runner.cleanup()
            if batcher_task is not None:
                batcher_task.cancel()
            executor.shutdown(wait=False)
            self.service.text_work.shutdown(wait=False)
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

    async def _serve(self, executor):
        """Listen, load, serve until stopped, then wait (at most --shutdown-timeout) for the
        requests in flight; the batcher's task, or None when stopped before the model loaded."""
        args = self.service.args
        try:
            listener = await self.loop.create_server(self.guard, self.host, self.port, reuse_address=True)
        except OSError as e:
            raise UserError(f"--host {self.host} --port {self.port}: cannot listen there ({e.strerror or e}): give "
                            "another --port (0: any free one)") from None
        self.port = listener.sockets[0].getsockname()[1]
        self.listening.set()
        shown_host = f"[{self.host}]" if ":" in self.host else self.host
        say(f"listening on http://{shown_host}:{self.port} (GET /health, GET /ready, GET /metrics, POST /translate); "
            "loading the model")
        loading = self.loop.run_in_executor(executor, self.service.load)
        stopped = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait([loading, stopped], return_when=asyncio.FIRST_COMPLETED)
        batcher_task = None
        if loading.done():
            loading.result()  # a model that cannot load: its UserError
            self.service.batcher = RequestBatcher(self.service.engine, args.max_batch_size, args.max_batch_wait,
                                                  args.max_queue, executor, on_batch=self.metrics.batch_decoded)
            batcher_task = asyncio.ensure_future(self.service.batcher.run())
            await asyncio.sleep(0)  # the batcher's loop runs before the first request comes
            self.service.ready = True
            wait = f"at most {args.max_batch_wait * 1000:g} ms after their first" if args.max_batch_wait else "at once"
            say(f"ready: --model-dir {args.model_dir} ({self.service.setup.engine} on {args.device}, "
                f"{args.threads} thread{'s' if args.threads != 1 else ''}, beam {args.beam}); batches of at most "
                f"{args.max_batch_size} sentences, leaving {wait}")
            await stopped
        self.stopping = True
        listener.close()  # no new connections
        say(f"stopping: no new connections; finishing {self.in_flight} request{'s' if self.in_flight != 1 else ''} "
            "in flight")
        deadline = self.loop.time() + self.shutdown_timeout
        while self.in_flight and self.loop.time() < deadline and not self._stop_now.is_set():
            await asyncio.sleep(0.01)
        return batcher_task


#: the routes, by path (the metrics' route label; any other path counts as "other")
ROUTES = ("/health", "/ready", "/metrics", "/translate")


@command
def main(argv=None):
    args = parse_args(argv)
    if web is None:
        missing = [name for name, module in SERVE_EXTRA.items() if importlib.util.find_spec(module) is None]
        missing = missing or ["aiohttp"]  # found, but it would not import
        verb = "is" if len(missing) == 1 else "are"
        raise UserError(f"fairseq-rope-serve needs {' and '.join(missing)}, which {verb} not installed: pip install "
                        "'fairseq-rope[serve]' (or run make setup)")
    service = Service(args, model_setup.check_served_model(args))  # its engine opens once the server listens
    asyncio.run(Server(service, args.host, args.port, args.shutdown_timeout).run())


if __name__ == "__main__":
    main()

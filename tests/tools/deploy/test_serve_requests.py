"""fairseq-rope-serve's parts in-process, with stand-in engines: a request body read and checked,
the batching across requests (concurrent requests share a batch and each gets its own results;
a batch leaves when full or after the wait; beam settings never share a batch; a full queue
refuses at once; a failed batch fails only its requests), a request's beam search reaching every
engine through the seam, and the server answering /health at once and /ready only once the model
is loaded (through a real HTTP client, on 127.0.0.1)."""

import asyncio
import collections
import contextlib
import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy import length_buckets
from fairseq_rope_tools.deploy.engine import Decoding, Engine, Hypothesis
from fairseq_rope_tools.deploy.fairseq_engine import FairseqEngine
from fairseq_rope_tools.deploy.model_setup import ModelSetup
from fairseq_rope_tools.deploy.request_batcher import QueueFull, RequestBatcher

serve = pytest.importorskip("fairseq_rope_tools.deploy.serve")
pytest.importorskip("aiohttp")


class Reverser(Engine):
    """Translates a source into its tokens reversed, scored -beam; records (decoding, batch) of
    every call, and can be held (``gate``) or fail on a source holding ``boom``."""

    def __init__(self, gate=None):
        self.calls, self.times, self.gate = [], [], gate

    def translate(self, batch, decoding=None):
        if self.gate is not None:
            assert self.gate.wait(timeout=30)
        self.calls.append((decoding, [list(s) for s in batch]))
        self.times.append(time.monotonic())
        if any("boom" in s for s in batch):
            raise RuntimeError("the engine failed on boom")
        beam = decoding.beam if decoding else 0
        return [[Hypothesis(s[::-1], -float(beam))] for s in batch]


def batcher_run(engine, coroutine_of, max_batch=64, max_wait=0.05, max_queue=1000):
    """``coroutine_of(batcher)`` run beside a RequestBatcher over ``engine``; its result."""
    import concurrent.futures

    async def run():
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
            batcher = RequestBatcher(engine, max_batch, max_wait, max_queue, executor)
            task = asyncio.ensure_future(batcher.run())
            await asyncio.sleep(0)
            try:
                return await coroutine_of(batcher)
            finally:
                task.cancel()

    return asyncio.run(run())


BEAM4 = Decoding(beam=4)


def test_concurrent_requests_share_a_batch_and_each_gets_its_own_results():
    requests = [[["a", "b"], ["c"]], [["d", "e", "f"]], [[]], [["g"], ["h", "i"], ["j"]]]
    engine = Reverser()

    async def send(batcher):
        return await asyncio.gather(*(batcher.translate(sources, BEAM4) for sources in requests))

    results = batcher_run(engine, send)
    assert [[[h.tokens for h in r] for r in result] for result in results] == [
        [[["b", "a"]], [["c"]]], [[["f", "e", "d"]]], [[]], [[["g"]], [["i", "h"]], [["j"]]]]
    assert len(engine.calls) == 1  # one batch, sorted by length as fairseq-rope-translate sorts a file
    assert engine.calls[0] == (BEAM4, [["c"], ["g"], ["j"], ["a", "b"], ["h", "i"], ["d", "e", "f"]])


def test_a_batch_leaves_when_full_or_after_the_wait():
    engine = Reverser()

    async def send(batcher):
        return await asyncio.gather(*(batcher.translate([[f"w{i}"]], BEAM4) for i in range(10)))

    began = time.monotonic()
    results = batcher_run(engine, send, max_batch=4, max_wait=1.0)
    assert [r[0][0].tokens for r in results] == [[f"w{i}"] for i in range(10)]
    assert [len(batch) for _, batch in engine.calls] == [4, 4, 2]
    # the full batches at once, the last one after the wait
    assert [t - began < 0.9 for t in engine.times] == [True, True, False]

    async def lone(batcher):
        began = time.monotonic()
        await batcher.translate([["w1"]], BEAM4)
        return time.monotonic() - began

    assert 0.2 <= batcher_run(Reverser(), lone, max_wait=0.2) < 5  # waited for company, then went alone


def test_a_request_larger_than_a_batch_goes_in_several_engine_batches():
    engine = Reverser()
    results = batcher_run(engine, lambda batcher: batcher.translate([[f"w{i}"] for i in range(10)], BEAM4),
                          max_batch=4)
    assert [r[0].tokens for r in results] == [[f"w{i}"] for i in range(10)]
    assert [len(batch) for _, batch in engine.calls] == [4, 4, 2]


def test_beam_settings_never_share_a_batch():
    engine = Reverser()
    settings = [Decoding(beam=2), Decoding(beam=4), Decoding(beam=2, nbest=2), Decoding(beam=4)]

    async def send(batcher):
        return await asyncio.gather(*(batcher.translate([[f"w{i}"]], settings[i % 4]) for i in range(12)))

    results = batcher_run(engine, send)
    assert [r[0][0].score for r in results] == [-float(settings[i % 4].beam) for i in range(12)]
    assert collections.Counter(d for d, b in engine.calls for _ in b) == collections.Counter(
        settings[i % 4] for i in range(12))  # each call one setting, with all its sentences
    assert len(engine.calls) == 3


def test_a_full_queue_refuses_at_once_and_takes_requests_again_once_it_drains():
    gate = threading.Event()
    engine = Reverser(gate)

    async def send(batcher):
        decoding = asyncio.ensure_future(batcher.translate([["first"]], BEAM4))  # held in the engine
        await asyncio.sleep(0.01)
        for _ in range(3000):  # until its batch has left the queue (bounded: 30 s)
            if not batcher.waiting:
                break
            await asyncio.sleep(0.01)
        assert not batcher.waiting
        queued = [asyncio.ensure_future(batcher.translate([["a"], ["b"]], BEAM4)),
                  asyncio.ensure_future(batcher.translate([["c"]], BEAM4))]
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull, match="3 sentences are waiting; the queue holds at most 3"):
            await batcher.translate([["d"]], BEAM4)
        gate.set()
        done = await asyncio.gather(decoding, *queued)
        again = await batcher.translate([["d"]], BEAM4)
        return done, again

    done, again = batcher_run(engine, send, max_queue=3, max_wait=0.01)
    assert [[h[0].tokens for h in r] for r in done] == [[["first"]], [["a"], ["b"]], [["c"]]]
    assert again[0][0].tokens == ["d"]


def test_a_failed_batch_fails_its_requests_and_the_next_batch_decodes():
    engine = Reverser()

    async def send(batcher):
        with pytest.raises(RuntimeError, match="the engine failed on boom"):
            await batcher.translate([["boom"]], BEAM4)
        return await batcher.translate([["w1", "w2"]], BEAM4)

    assert batcher_run(engine, send)[0][0].tokens == ["w2", "w1"]


# --- a request's beam search through the seam -------------------------------------------------------
def test_the_router_passes_a_requests_decoding_to_the_bucket_models(tmp_path, monkeypatch):
    monkeypatch.setattr(length_buckets, "verified_bucket_manifest", lambda directory: {
        "training_length": 4, "buckets": [{"factor": 1.0, "directory": "plain"}, {"factor": 2.0, "directory": "yarn_x2"}]})
    models = {}
    router = length_buckets.LengthBuckets(tmp_path, lambda directory: models.setdefault(directory.name, Reverser()),
                                          keep_loaded=True)
    decoding = Decoding(beam=2, nbest=2)
    router.translate([["w"] * 2, ["w"] * 6], decoding)
    assert [calls for name in ("plain", "yarn_x2") for calls in models[name].calls] == [
        (decoding, [["w"] * 2]), (decoding, [["w"] * 6])]
    router.translate([["w"] * 2])
    assert models["plain"].calls[-1] == (None, [["w"] * 2])  # without one: the engine's own


def test_the_fairseq_engine_decodes_with_a_requests_beam_and_nbest():
    """Its hub's generate gets the request's beam and nbest (and keeps the engine's own without)."""
    class Hub:
        class cfg:
            class dataset:
                batch_size = None

        class tgt_dict:
            @staticmethod
            def string(tokens):
                return " ".join(tokens)

        def __init__(self):
            self.options = []

        def binarize(self, sentence):
            return sentence.split()

        def generate(self, tokens, **options):
            self.options.append(options)
            return [[{"tokens": t, "score": -k} for k in range(options["beam"])] for t in tokens]

    engine = FairseqEngine.__new__(FairseqEngine)
    engine.hub, engine.decoding = Hub(), Decoding(beam=4, nbest=1)
    engine.open_dict, engine.torch = contextlib.nullcontext, type("torch", (), {"inference_mode": contextlib.nullcontext})
    assert [len(r) for r in engine.translate([["w1"], ["w2"]], Decoding(beam=3, nbest=2))] == [2, 2]
    assert (engine.hub.options[-1]["beam"], engine.hub.options[-1]["nbest"]) == (3, 2)
    assert [len(r) for r in engine.translate([["w1"]])] == [1]
    assert (engine.hub.options[-1]["beam"], engine.hub.options[-1]["nbest"]) == (4, 1)


# --- a request read and checked ------------------------------------------------------------------------
def read(payload, **limits):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return serve.read_request(body, limits.get("beam", 4), limits.get("max_beam", 8), limits.get("max_lines", 10))


def test_a_request_gets_the_servers_beam_one_hypothesis_and_no_scores_unless_it_asks():
    assert read({"text": ["a b", ""]}) == (["a b", ""], 4, 1, False)
    assert read({"text": [], "beam_size": 8, "nbest": 8, "scores": True}) == ([], 8, 8, True)


@pytest.mark.parametrize("payload, message", [
    ({"text": ["a"], "beam_size": True}, '"beam_size" must be an integer from 1 to 8 (--max-beam), not true'),
    ({"text": ["a"], "beam_size": 2.0}, '"beam_size" must be an integer from 1 to 8 (--max-beam), not 2.0'),
    ({"text": ["a"], "beam_size": 0}, '"beam_size" must be an integer from 1 to 8 (--max-beam), not 0'),
    ({"text": ["a"], "nbest": 5}, '"nbest" must be an integer from 1 to 4 (the beam size), not 5'),
    ({"text": None}, '"text" must be a list of strings, not null'),
    ({"text": ["a", {"b": 1}]}, '"text"[1] must be a string, not an object'),
    ({"text": ["a\u2028b"]}, '"text"[0] holds a line break (U+2028)'),
    (b'"text"', "the request body is a string, not a JSON object"),
    (b"", "the request body is not JSON (Expecting value at line 1 column 1)"),
])
def test_a_bad_value_is_named(payload, message):
    with pytest.raises(serve.RequestError, match="^" + re.escape(message)) as refused:
        read(payload)
    assert refused.value.status == 400


# --- the server: alive at once, ready once the model is loaded ------------------------------------------
#: a stand-in model's setup: its tokens are the output, as they come; English text to split
TOKENS_AS_THEY_COME = ModelSetup("ctranslate2", output_format="bpe", model_dir="unused", src="en")


class HeldService(serve.Service):
    """The model loads when ``loaded`` is set (or fails with ``failure``): a Reverser, no segmentation."""

    def __init__(self, args, failure=None):
        super().__init__(args, TOKENS_AS_THEY_COME)
        self.loaded, self.failure = threading.Event(), failure

    def load(self):
        assert self.loaded.wait(timeout=30)
        if self.failure:
            raise self.failure
        self.engine, self.segment = Reverser(), str.split


def server_args():
    return serve.parse_args(["--model-dir", "unused", "--port", "0", "--max-batch-wait", "0"])


def http(port, method, path, payload=None):
    """(status, headers, JSON answer) from a real HTTP client."""
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def serve_until_done(server, client):
    """Run ``server`` while ``client()`` talks to it from a thread; the server is stopped once the
    client is done, whatever it raised."""
    def run_client():
        try:
            client()
        finally:
            server.stop()

    thread = threading.Thread(target=run_client)
    thread.start()
    asyncio.run(server.run())
    thread.join(timeout=30)


def test_the_server_is_alive_at_once_and_ready_only_once_the_model_is_loaded():
    service = HeldService(server_args())
    server = serve.Server(service, "127.0.0.1", 0, shutdown_timeout=10)
    seen = {}

    def client():
        try:
            assert server.listening.wait(timeout=30)
            seen["health"] = http(server.port, "GET", "/health")
            seen["loading"] = http(server.port, "GET", "/ready")
            seen["translate while loading"] = http(server.port, "POST", "/translate", {"text": ["a b"]})
            service.loaded.set()
            wait_until(lambda: http(server.port, "GET", "/ready")[0] == 200, "ready")
            seen["ready"] = http(server.port, "GET", "/ready")
            seen["translate"] = http(server.port, "POST", "/translate", {"text": ["a b c", ""], "scores": True})
        finally:
            service.loaded.set()

    serve_until_done(server, client)
    assert seen["health"][::2] == (200, {"status": "alive"})
    assert seen["loading"][::2] == (503, {"ready": False})
    status, headers, answer = seen["translate while loading"]
    assert (status, headers["Retry-After"]) == (503, "1")
    assert answer == {"error": "the model is still loading: retry once GET /ready answers 200"}
    assert seen["ready"][::2] == (200, {"ready": True, "waiting": 0, "batches": 0, "sentences": 0})
    assert seen["translate"][::2] == (200, {"translations": ["c b a", ""], "scores": [-4.0, None]})


def test_a_model_that_cannot_load_stops_the_server_with_its_error():
    service = HeldService(server_args(), failure=UserError("--compute-type float16 is not supported by CTranslate2"))
    service.loaded.set()
    with pytest.raises(UserError, match="--compute-type float16 is not supported"):
        asyncio.run(serve.Server(service, "127.0.0.1", 0, shutdown_timeout=10).run())


def test_a_port_in_use_is_refused_in_one_line():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"--host 127.0.0.1 --port {port}: cannot listen there .*: give another "
                                            r"--port \(0: any free one\)"):
            asyncio.run(serve.Server(HeldService(server_args()), "127.0.0.1", port, shutdown_timeout=10).run())


def wait_until(condition, what, timeout=30):
    """Poll ``condition()`` until true; fails after ``timeout`` seconds (a test's loops are bounded)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {timeout} s"
        time.sleep(0.01)


def stop_with_a_request_held_in_the_engine(shutdown_timeout, stops):
    """A server whose engine holds the one request in flight, stopped ``stops`` times: (the
    UserError it stops with, the seconds from the first stop to its end, the client's answers)."""
    service = HeldService(server_args())
    service.loaded.set()
    gate = threading.Event()
    server = serve.Server(service, "127.0.0.1", 0, shutdown_timeout=shutdown_timeout)
    answers, stopped_at = [], []

    def client():
        assert server.listening.wait(timeout=30)
        wait_until(lambda: http(server.port, "GET", "/ready")[0] == 200, "ready")
        service.engine.gate = gate  # the next batch is held in the engine

        def send():
            try:
                answers.append(http(server.port, "POST", "/translate", {"text": ["a"]}))
            except OSError as e:  # unanswered: the server stopped without it
                answers.append(type(e).__name__)

        sender = threading.Thread(target=send)
        sender.start()
        wait_until(lambda: server.in_flight > 0, "in flight")
        time.sleep(0.1)  # in the engine
        stopped_at.append(time.monotonic())
        for _ in range(stops):
            server.stop()
        sender.join(timeout=30)

    thread = threading.Thread(target=client)
    thread.start()
    try:
        with pytest.raises(UserError) as stopped:
            asyncio.run(server.run())
        seconds = time.monotonic() - stopped_at[0]
    finally:
        gate.set()
        thread.join(timeout=30)
    return stopped.value, seconds, answers


def test_requests_that_outlast_the_shutdown_timeout_are_reported():
    error, _, answers = stop_with_a_request_held_in_the_engine(shutdown_timeout=0.5, stops=1)
    assert str(error) == "1 request still in flight after --shutdown-timeout 0.5 s: stopped without answering them"
    assert error.status == 1 and answers == ["RemoteDisconnected"]


def test_a_second_stop_signal_stops_at_once():
    """The operator who sends SIGTERM (or Ctrl-C) twice does not wait for the drain."""
    error, seconds, answers = stop_with_a_request_held_in_the_engine(shutdown_timeout=60, stops=2)
    assert str(error) == ("1 request still in flight after a second SIGTERM or SIGINT: stopped without answering "
                          "them")
    assert error.status == 1 and seconds < 10 and answers == ["RemoteDisconnected"]


def test_an_internal_error_is_a_500_in_one_line_with_its_traceback_in_the_log(capsys):
    """A batch the engine fails on: its request gets a one-line 500, the log the traceback, and
    the server goes on translating."""
    service = HeldService(server_args())
    service.loaded.set()
    server = serve.Server(service, "127.0.0.1", 0, shutdown_timeout=10)
    seen = {}

    def client():
        assert server.listening.wait(timeout=30)
        wait_until(lambda: http(server.port, "GET", "/ready")[0] == 200, "ready")
        seen["failed"] = http(server.port, "POST", "/translate", {"text": ["a boom"]})
        seen["next"] = http(server.port, "POST", "/translate", {"text": ["a b"]})

    serve_until_done(server, client)
    assert seen["failed"][::2] == (500, {"error": "internal error: the engine failed on boom"})
    assert seen["next"][::2] == (200, {"translations": ["b a"]})
    log = capsys.readouterr().err
    assert '[serve] internal error on "POST /translate":\nTraceback (most recent call last):' in log
    assert "RuntimeError: the engine failed on boom" in log
    assert '"POST /translate" 500 lines=1 ms=' in log


def test_without_aiohttp_the_command_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(serve, "web", None)
    with pytest.raises(SystemExit) as stopped:
        serve.main(["--model-dir", "unused"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.endswith("error: fairseq-rope-serve needs aiohttp, which is not installed: pip "
                                            "install 'fairseq-rope[serve]' (or run make setup)\n")


def test_a_default_beam_over_the_largest_is_refused(capsys):
    with pytest.raises(SystemExit) as stopped:
        serve.parse_args(["--model-dir", "m", "--beam", "9"])
    assert stopped.value.code == 2
    assert "error: --beam 9: the default beam size must be at most --max-beam 8" in capsys.readouterr().err


def test_more_lines_per_request_than_the_queue_holds_is_refused(capsys):
    """Such a request could never be queued: every one would get a 503 that never clears. Left
    out, --max-lines is the smaller of 256 and --max-queue."""
    with pytest.raises(SystemExit) as stopped:
        serve.parse_args(["--model-dir", "m", "--max-lines", "300", "--max-queue", "200"])
    assert stopped.value.code == 2
    assert "error: --max-lines 300 must be at most --max-queue 200" in capsys.readouterr().err
    assert serve.parse_args(["--model-dir", "m", "--max-queue", "200"]).max_lines == 200
    assert serve.parse_args(["--model-dir", "m"]).max_lines == 256


@pytest.mark.parametrize("values, q", [([3.0], 50), ([1.0, 2.0], 50), ([5.0, 1.0, 4.0, 2.0, 3.0], 95),
                                       ([float(i * i) for i in range(37)], 95), ([2.0, 2.0, 9.0], 0)])
def test_the_benchmarks_percentile_is_numpys_linear_one(values, q):
    numpy = pytest.importorskip("numpy")
    from fairseq_rope_tools.research.benchmarks.serve_load import percentile

    assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))


class ShortModelService(serve.Service):
    """A Reverser that takes at most 4 tokens and the </s>; words are tokens; English text."""

    def __init__(self, args):
        super().__init__(args, TOKENS_AS_THEY_COME)

    def load(self):
        self.engine, self.segment = Reverser(), str.split
        self.engine.max_source = 5


@pytest.mark.parametrize("flags", [[], ["--too-long-sentence", "skip"], ["--too-long", "refuse"]])
def test_a_text_too_long_is_split_into_sentences_and_joined_back(flags):
    """--too-long split (the default): each sentence of a text too long translated alone and the
    translations joined in order, counted in /metrics; a sentence still too long is a 413, or
    left out with --too-long-sentence skip; --too-long refuse answers 413 for the text."""
    args = serve.parse_args(["--model-dir", "unused", "--port", "0", *flags])
    service = ShortModelService(args)
    server = serve.Server(service, "127.0.0.1", 0, shutdown_timeout=10)
    seen = {}

    def client():
        assert server.listening.wait(timeout=30)
        wait_until(lambda: http(server.port, "GET", "/ready")[0] == 200, "ready")
        seen["split"] = http(server.port, "POST", "/translate", {"text": ["One two three. Four five six. Seven eight", "Hi there", ""]})
        seen["one too long"] = http(server.port, "POST", "/translate",
                                    {"text": ["Yes sir. Nine ten eleven twelve thirteen fourteen. Go home"]})
        seen["too many"] = http(server.port, "POST", "/translate", {"text": ["Yes. " * 300]})

        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as response:
            seen["metrics"] = response.read().decode()

    serve_until_done(server, client)
    metrics = dict(re.findall(r"^(fairseq_rope_(?:split_texts|sentences_left_out)_total) (\S+)$", seen["metrics"],
                              re.M))
    if flags == ["--too-long", "refuse"]:
        text = "One two three. Four five six. Seven eight"
        assert seen["split"][::2] == (413, {"error": f'"text"[0] has 8 words and {len(text)} characters; the model '
                                                     "takes at most 4 BPE tokens (--max-source-positions): split the "
                                                     "sentence"})
        assert metrics == {"fairseq_rope_split_texts_total": "0.0", "fairseq_rope_sentences_left_out_total": "0.0"}
        return
    assert seen["split"][::2] == (200, {"translations": ["three. two One six. five Four eight Seven", "there Hi", ""]})
    if flags:
        assert seen["one too long"][::2] == (200, {"translations": ["sir. Yes home Go"]})
    else:
        sentence = "Nine ten eleven twelve thirteen fourteen."
        assert seen["one too long"][::2] == (413, {"error": f'"text"[0]\'s sentence 2 has 6 words and {len(sentence)} '
                                                            "characters; the model takes at most 4 BPE tokens "
                                                            "(--max-source-positions): split the sentence"})
    assert seen["too many"][::2] == (413, {"error": '"text"[0] splits into 300 sentences: with the request\'s others, '
                                                    "more than the 256 the server takes in one request (--max-lines): "
                                                    "send fewer"})
    assert metrics == {"fairseq_rope_split_texts_total": "3.0",
                       "fairseq_rope_sentences_left_out_total": "1.0" if flags else "0.0"}


# the model reverses its tokens and takes 4: the first text fits, the others do not; in the last,
# the first two sentences together do not either
@pytest.mark.parametrize("per_input, translations", [
    (None, ["home Go there. Hi", "home. Go down. Sit now Eat", "now. home Go down. Sit Eat"]),
    ("1", ["there. Hi home Go", "home. Go down. Sit now Eat", "now. home Go down. Sit Eat"]),
    ("2", ["home Go there. Hi", "down. Sit home. Go now Eat", "now. home Go down. Sit Eat"]),
])
def test_texts_of_more_sentences_than_max_sentences_per_input_go_that_many_at_a_time(per_input, translations):
    """--max-sentences-per-input N (with --too-long split): a text of more than N sentences is
    translated N sentences at a time and joined back, whether or not it fits whole; a group that
    does not fit goes sentence by sentence; as fairseq-rope-translate's flag (one declaration)."""
    flags = ["--max-sentences-per-input", per_input] if per_input else []
    service = ShortModelService(serve.parse_args(["--model-dir", "unused", "--port", "0", *flags]))
    server = serve.Server(service, "127.0.0.1", 0, shutdown_timeout=10)
    seen = {}

    def client():
        assert server.listening.wait(timeout=30)
        wait_until(lambda: http(server.port, "GET", "/ready")[0] == 200, "ready")
        seen["answer"] = http(server.port, "POST", "/translate",
                              {"text": ["Hi there. Go home", "Go home. Sit down. Eat now", "Go home now. Sit down. Eat"]})

    serve_until_done(server, client)
    assert seen["answer"][::2] == (200, {"translations": translations})


@pytest.mark.parametrize("flags", [["--max-sentences-per-input", "0"], ["--max-sentences-per-input", "2",
                                                                        "--too-long", "refuse"]])
def test_max_sentences_per_input_needs_a_positive_number_and_split(flags, capsys):
    with pytest.raises(SystemExit) as stopped:
        serve.parse_args(["--model-dir", "m", *flags])
    assert stopped.value.code == 2
    assert f"error: --max-sentences-per-input {flags[1]}: give a number >= 1, with --too-long split" in \
        capsys.readouterr().err

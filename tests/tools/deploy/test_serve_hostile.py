"""fairseq-rope-serve against hostile and careless clients, on 127.0.0.1 through raw sockets and
a real HTTP client, with stand-in models (tests/tools/deploy/test_serve_requests.py's): a sentence that cannot
fit is refused before any tokenisation, and a slow segmentation never holds /health; a full queue
refuses before segmenting; idle, slow and surplus connections are closed; a body that cannot
come, compressed, not declared JSON, or nested without end is one line of JSON; aiohttp's own
refusals are JSON too; a client gone is one log line and its queued work is never decoded; the
access log escapes what the client sent; no versions in the Server header; --allowed-hosts;
GET /metrics. Every wait is bounded."""

import asyncio
import json
import socket
import threading
import time

import pytest
from test_serve_requests import HeldService, Reverser, http, serve_until_done, wait_until

serve = pytest.importorskip("fairseq_rope_tools.deploy.serve")
pytest.importorskip("prometheus_client")

LIMIT = 40  # the stand-in model's source positions


class CountingService(HeldService):
    """Loaded at once; its segmenter records what it was given and may be slow (``delay`` seconds a
    sentence, blocking, as BPE over a long word is)."""

    def __init__(self, args, delay=0.0, gate=None):
        super().__init__(args)
        self.loaded.set()
        self.segmented, self.on_loop, self.delay, self.gate = [], [], delay, gate

    def load(self):
        super().load()
        self.engine = Reverser(self.gate)
        self.engine.max_source = LIMIT
        self.segment = self._segment

    def _segment(self, sentence):
        self.segmented.append(sentence)
        self.on_loop.append(on_an_event_loop())
        time.sleep(self.delay)
        return sentence.split()


def on_an_event_loop() -> bool:
    """Whether this runs in an event loop's thread, in one of its callbacks."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def args_with(*flags):
    return serve.parse_args(["--model-dir", "unused", "--port", "0", "--max-batch-wait", "0", *map(str, flags)])


def served(client, *flags, delay=0.0, gate=None):
    """Run a server with ``flags`` while ``client(server, service)`` talks to it; (server, service)."""
    service = CountingService(args_with(*flags), delay, gate)
    server = serve.Server(service, "127.0.0.1", 0, shutdown_timeout=5)

    def run_client():
        assert server.listening.wait(timeout=30)
        wait_until(lambda: http(server.port, "GET", "/ready")[0] == 200, "ready")
        client(server, service)

    serve_until_done(server, run_client)
    return server, service


def raw(port, data: bytes, timeout=10.0, then_wait=True):
    """What the server sends back on a connection given ``data``, until it closes it (or ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return read_until_closed(s, timeout) if then_wait else b""


def read_until_closed(s, timeout):
    received, deadline = b"", time.monotonic() + timeout
    s.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except ConnectionError:  # closed with what we sent unread: a reset, after the answer
            return received
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"the connection was still open after {timeout} s; received {received[:200]!r}")


def status_and_json(answer: bytes):
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = dict(line.split(": ", 1) for line in head.decode("latin-1").split("\r\n")[1:])
    return status, headers, body


def post(body: bytes, content_type="application/json", extra=""):
    return (f"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n").encode() + body


# --- a long sentence holds nothing ---------------------------------------------------------------
@pytest.mark.parametrize("too_long", ["split", "refuse"])
@pytest.mark.parametrize("sentence", ["x" * 200_000, "w " * 100], ids=["a 200 KB word", "more words than positions"])
def test_a_sentence_that_cannot_fit_is_refused_before_any_segmentation(sentence, too_long):
    """Never tokenized: with --too-long refuse the request is refused first; split into sentences
    (one here), the sentence is refused before its tokenisation."""
    seen = {}
    _, service = served(lambda server, _: seen.update(answer=http(server.port, "POST", "/translate",
                                                                   {"text": ["a b", sentence]})),
                        "--max-body-bytes", 1 << 20, "--too-long", too_long)
    status, _, answer = seen["answer"]
    assert status == 413 and answer["error"].startswith('"text"[1] has ') and "split the sentence" in answer["error"]
    assert service.segmented == ([] if too_long == "refuse" else ["a b"])


def test_health_answers_while_a_request_is_segmented():
    """Segmentation that takes 3 s (BPE over long words does) runs beside the event loop."""
    seen, words = {}, ["a" * 150, "b" * 150, "c" * 150]

    def client(server, service):
        slow = threading.Thread(target=lambda: seen.update(answer=http(server.port, "POST", "/translate",
                                                                        {"text": [" ".join(words)]})))
        slow.start()
        wait_until(lambda: service.segmented, "segmenting")
        began = time.monotonic()
        seen["health"] = http(server.port, "GET", "/health")
        seen["seconds"] = time.monotonic() - began
        slow.join(timeout=30)

    served(client, delay=3.0)
    assert seen["health"][0] == 200 and seen["seconds"] < 1.5, seen
    assert seen["answer"][::2] == (200, {"translations": [" ".join(reversed(words))]})


def test_no_request_is_segmented_on_the_event_loop():
    """A short request's text goes to the text thread too: a flood of short texts made slow to
    segment would hold /health for seconds on the loop."""
    seen = {}
    _, service = served(lambda server, _: seen.update(short=http(server.port, "POST", "/translate", {"text": ["a b c"]})))
    assert seen["short"][0] == 200 and service.on_loop == [False]


def test_a_full_queue_refuses_before_segmenting():
    gate, seen = threading.Event(), {}

    def client(server, service):
        first = threading.Thread(target=lambda: seen.update(first=http(server.port, "POST", "/translate",
                                                                        {"text": ["a", "b", "c"]})))
        first.start()
        wait_until(lambda: server.service.batcher.waiting == 0 and service.engine.gate is gate
                   and len(service.segmented) == 3, "in the engine")
        second = threading.Thread(target=lambda: seen.update(second=http(server.port, "POST", "/translate",
                                                                          {"text": ["d", "e", "f"]})))
        second.start()
        wait_until(lambda: server.service.batcher.waiting == 3 and len(service.segmented) == 6, "queued")
        segmented = len(service.segmented)
        seen["refused"] = http(server.port, "POST", "/translate", {"text": ["g", "h"]})
        seen["segmented"] = len(service.segmented) - segmented
        gate.set()
        first.join(timeout=30)
        second.join(timeout=30)

    served(client, "--max-queue", 4, "--max-lines", 4, gate=gate)
    assert seen["refused"][0] == 503 and seen["segmented"] == 0, seen
    assert seen["first"][0] == seen["second"][0] == 200


# --- connections: a cap, and timeouts for the head, the body, and idleness ------------------------
def test_connections_over_the_cap_get_a_503_and_are_closed_and_idle_ones_time_out():
    seen = {}

    def client(server, _):
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(2)]
        try:
            time.sleep(0.2)
            began = time.monotonic()
            seen["surplus"] = raw(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            seen["surplus seconds"] = time.monotonic() - began
            began = time.monotonic()
            seen["idle"] = read_until_closed(idle[0], 10)  # --head-timeout 1
            seen["idle seconds"] = time.monotonic() - began
        finally:
            for s in idle:
                s.close()
        wait_until(lambda: server.guard.open == 0, "closed")
        seen["after"] = http(server.port, "GET", "/health")

    server, _ = served(client, "--max-connections", 2, "--head-timeout", 1)
    status, headers, body = status_and_json(seen["surplus"])
    assert status == 503 and headers["Content-Type"].startswith("application/json") and seen["surplus seconds"] < 2
    assert json.loads(body) == {"error": "the server has 2 connections open (--max-connections): retry later"}
    status, _, body = status_and_json(seen["idle"])
    assert status == 408 and "--head-timeout" in json.loads(body)["error"] and seen["idle seconds"] < 3
    assert seen["after"][0] == 200
    assert server.guard.refused >= 1 and server.guard.timed_out >= 1


def test_a_trickled_head_is_cut_off_at_the_head_timeout():
    seen = {}

    def client(server, _):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            began = time.monotonic()
            s.sendall(b"GET /health HTTP/1.1\r\n")
            try:
                for _ in range(40):  # a byte every 0.1 s: never a whole head
                    s.sendall(b"X")
                    time.sleep(0.1)
            except OSError:
                pass
            seen["seconds"] = time.monotonic() - began

    served(client, "--head-timeout", 1)
    assert seen["seconds"] < 3.5, seen


def test_an_idle_kept_alive_connection_is_closed_after_the_keepalive_timeout():
    seen = {}

    def client(server, _):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            began = time.monotonic()
            answer = read_until_closed(s, 10)
            seen["answer"], seen["seconds"] = answer, time.monotonic() - began

    served(client, "--keepalive-timeout", 1)
    assert seen["answer"].startswith(b"HTTP/1.1 200") and 0.5 < seen["seconds"] < 4, seen


def test_a_huge_declared_body_is_refused_at_once_and_a_slow_body_times_out():
    seen = {}

    def client(server, _):
        began = time.monotonic()
        seen["huge"] = raw(server.port, b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                        b"Content-Length: 1000000000000\r\n\r\n{")
        seen["huge seconds"] = time.monotonic() - began
        began = time.monotonic()
        seen["slow"] = raw(server.port, b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                        b"Content-Length: 100\r\n\r\n{\"text\":")
        seen["slow seconds"] = time.monotonic() - began

    served(client, "--body-timeout", 1)
    status, _, body = status_and_json(seen["huge"])
    assert status == 413 and "--max-body-bytes" in json.loads(body)["error"] and seen["huge seconds"] < 3
    status, _, body = status_and_json(seen["slow"])
    assert status == 408 and "--body-timeout" in json.loads(body)["error"] and seen["slow seconds"] < 4


# --- what the body says: one line of JSON for each refusal ----------------------------------------
@pytest.mark.parametrize("request_bytes, status, says", [
    (post(b"[" * 100_000), 400, "nested too deeply"),
    (post(b'{"text": ["a"]}', extra="Content-Encoding: gzip\r\n"), 415, "Content-Encoding gzip"),
    (post(b'{"text": ["a"]}', content_type="text/plain"), 415, "Content-Type is text/plain"),
    (post(json.dumps({"x" * 100_000: 1}).encode()), 400, "unknown field"),
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "not a valid HTTP request"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20_000 + b"\r\n\r\n", 400, "Got more than 8190 bytes"),
], ids=["nested JSON", "gzip", "text/plain", "a 100 KB field name", "not HTTP", "a header too long"])
def test_every_refusal_is_one_short_line_of_json(capsys, request_bytes, status, says):
    seen = {}

    def client(server, _):
        seen["answer"] = raw(server.port, request_bytes)
        seen["after"] = http(server.port, "POST", "/translate", {"text": ["a b"]})

    served(client, "--max-body-bytes", 1 << 20)
    got, headers, body = status_and_json(seen["answer"])
    error = json.loads(body)["error"]
    assert got == status and says in error and "\n" not in error and len(error) < 400, (got, error)
    assert headers["Content-Type"].startswith("application/json")
    assert seen["after"][::2] == (200, {"translations": ["b a"]})
    log = capsys.readouterr().err
    assert "Traceback" not in log and len(log) < 4000, log


# --- clients that go away -------------------------------------------------------------------------
def test_a_client_gone_mid_upload_is_one_log_line(capsys):
    def client(server, _):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"text\": [")
            time.sleep(0.3)
        wait_until(lambda: server.in_flight == 0, "done")
        time.sleep(0.2)

    served(client)
    log = capsys.readouterr().err
    assert "Traceback" not in log and " 500 " not in log, log
    assert sum("client gone" in line for line in log.splitlines()) == 1, log


def test_a_queued_request_whose_client_went_away_is_never_decoded(capsys):
    gate, seen = threading.Event(), {}

    def client(server, service):
        first = threading.Thread(target=lambda: seen.update(first=http(server.port, "POST", "/translate",
                                                                        {"text": ["held"]})))
        first.start()
        wait_until(lambda: server.service.batcher.waiting == 0 and len(service.segmented) == 1, "in the engine")
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            body = json.dumps({"text": ["gone away"]}).encode()
            s.sendall(post(body))
            wait_until(lambda: server.service.batcher.waiting == 1, "queued")
        wait_until(lambda: server.service.batcher.waiting == 0, "dropped from the queue")
        gate.set()
        first.join(timeout=30)
        seen["after"] = http(server.port, "POST", "/translate", {"text": ["a b"]})

    _, service = served(client, gate=gate)
    decoded = [source for _, batch in service.engine.calls for source in batch]
    assert decoded == [["held"], ["a", "b"]]  # never ["gone", "away"]
    assert seen["first"][0] == seen["after"][0] == 200
    log = capsys.readouterr().err
    assert sum("client gone" in line for line in log.splitlines()) == 1 and "Traceback" not in log, log


# --- what the log and the headers say --------------------------------------------------------------
def test_the_access_log_escapes_the_path_and_no_version_is_disclosed(capsys):
    seen = {}

    def client(server, _):
        seen["answer"] = raw(server.port, b"GET /x%0A%5Bserve%5D%20forged%1B%5B31m HTTP/1.1\r\nHost: x\r\n"
                                          b"Connection: close\r\n\r\n")

    served(client)
    status, headers, _ = status_and_json(seen["answer"])
    assert status == 404 and headers["Server"] == "fairseq-rope-serve"
    log = capsys.readouterr().err
    assert "\x1b" not in log and not any(line.startswith("[serve] forged") for line in log.splitlines()), log
    assert '"GET /x%0A%5Bserve%5D%20forged%1B%5B31m" 404' in log


def test_allowed_hosts_answers_only_those_hosts():
    seen = {}

    def client(server, _):
        seen["other"] = raw(server.port, b"GET /health HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n")
        seen["ours"] = raw(server.port, f"GET /health HTTP/1.1\r\nHost: localhost:{server.port}\r\n"
                                        "Connection: close\r\n\r\n".encode())

    served(client, "--allowed-hosts", "localhost,127.0.0.1")
    status, _, body = status_and_json(seen["other"])
    assert status == 421 and "--allowed-hosts" in json.loads(body)["error"]
    assert status_and_json(seen["ours"])[0] == 200


def test_metrics_count_requests_sentences_batches_and_connections():
    seen = {}

    def client(server, _):
        http(server.port, "POST", "/translate", {"text": ["a b", "c"]})
        http(server.port, "POST", "/translate", {"text": "not a list"})
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            seen["answer"] = read_until_closed(s, 10)

    served(client)
    status, headers, body = status_and_json(seen["answer"])
    text = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=")
    assert 'fairseq_rope_requests_total{route="/translate",status="200"} 1.0' in text
    assert 'fairseq_rope_requests_total{route="/translate",status="400"} 1.0' in text
    assert "fairseq_rope_sentences_total 2.0" in text and "fairseq_rope_batch_sentences_count 1.0" in text
    assert "fairseq_rope_connections_open 1.0" in text  # this one
    assert 'fairseq_rope_connections_refused_total{reason="max_connections"} 0.0' in text


@pytest.mark.parametrize("flags, says", [
    (["--max-connections", "100000000"], "--max-connections 100000000: this process may open"),
    (["--head-timeout", "0"], "--head-timeout must be a number of seconds > 0, not 0.0"),
    (["--keepalive-timeout", "inf"], "--keepalive-timeout must be a number of seconds > 0, not inf"),
    (["--allowed-hosts", " , "], "--allowed-hosts: give host names separated by commas"),
], ids=["more connections than files", "no head timeout", "an endless keep-alive", "no host"])
def test_the_limits_flags_are_checked(capsys, flags, says):
    with pytest.raises(SystemExit) as stopped:
        serve.parse_args(["--model-dir", "unused", *flags])
    assert stopped.value.code == 2 and says in capsys.readouterr().err


def test_the_default_connection_cap_fits_the_descriptor_limit(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (200, 200))
    assert serve.parse_args(["--model-dir", "unused"]).max_connections == 200 - serve.RESERVED_DESCRIPTORS

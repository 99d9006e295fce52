"""fairseq-rope-serve against a live server: started as users start it (the command, in a
subprocess, on 127.0.0.1 and a free port) and talked to through a real HTTP client (http.client).
Its translations are fairseq-rope-translate's for the same bundle and settings (one request or
many, n-best with scores, another beam size); every bad request is a 4xx with a one-line JSON
error and the server goes on serving; a full queue answers 503 with Retry-After; 32 concurrent
clients sending different sentences each get their own translations, batched together; SIGTERM
during load completes every request the server had taken and exits 0; an ONNX export of the same
model serves as fairseq-rope-translate translates with it. Request loops are bounded in count and
time.

The model: a tiny RoPE model (at most 40 source positions) trained for 150 updates on the
reversal corpus, exported as a bundle with the segmentation of a work dir as prepare.sh leaves it:
enough for different sentences to get different translations, which the concurrency tests need
to see a mix-up."""

import http.client
import json
import random
import signal
import subprocess
import threading
import time

import pytest
from support.commands import cli_command, run_cli
from support.corpora import subword_work_dir

from fairseq_rope_tools.deploy.exported import read_export_info

pytest.importorskip("ctranslate2")
pytest.importorskip("aiohttp")

pytestmark = pytest.mark.e2e  # trains a model and runs the commands
MAX_SOURCE = 40


@pytest.fixture(scope="module")
def bundle(tiny_data_bin, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_bundle")
    work = subword_work_dir(root, tiny_data_bin)
    run_cli(["fairseq-train", work / "data-bin", "--user-dir", "fairseq_rope", "--arch", "transformer_rope_tiny",
             "--max-source-positions", MAX_SOURCE, "--task", "translation", "--cpu", "--optimizer", "adam", "--lr",
             "5e-3", "--max-tokens", "1500", "--max-update", "150", "--criterion", "cross_entropy",
             "--disable-validation", "--no-epoch-checkpoints", "--save-dir", root / "checkpoints", "--num-workers", "0",
             "--log-format", "simple"])
    out = root / "bundle"
    run_cli(["fairseq-rope-export", "--checkpoint", root / "checkpoints" / "checkpoint_last.pt", "--data-bin",
             work / "data-bin", "--work-dir", work, "--output-dir", out])
    return out


def translate_with_the_command(bundle, tmp_path, sentences, *flags):
    """fairseq-rope-translate's output lines for ``sentences`` (a file of them)."""
    source = tmp_path / f"source{len(list(tmp_path.iterdir()))}.en"
    source.write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
    out = source.with_suffix(".out")
    run_cli(["fairseq-rope-translate", "--model-dir", bundle, source, "-o", out, "--threads", "1", *flags])
    return out.read_text(encoding="utf-8").split("\n")[:-1]


@pytest.fixture(scope="module")
def sentences(bundle, tmp_path_factory):
    """{sentence: the command's translation} for sentences of the corpus' kind, one per distinct
    translation (so that a translation given to the wrong sentence shows), at least 96."""
    rng = random.Random(7)
    pool = list(dict.fromkeys(" ".join(f"w{rng.randrange(40)}" for _ in range(rng.randint(1, 12)))
                              for _ in range(600)))
    translations = translate_with_the_command(bundle, tmp_path_factory.mktemp("serve_sentences"), pool)
    by_translation = {}
    for sentence, translation in zip(pool, translations):
        by_translation.setdefault(translation, sentence)
    assert len(by_translation) >= 96, f"only {len(by_translation)} distinct translations: train the model longer"
    return {sentence: translation for translation, sentence in by_translation.items()}


class LiveServer:
    """fairseq-rope-serve in a subprocess, listening on 127.0.0.1 at a free port; its stderr
    lines collected as they come."""

    def __init__(self, bundle, *flags):
        cmd, env = cli_command(["fairseq-rope-serve", "--model-dir", bundle, "--host", "127.0.0.1", "--port", "0",
                                "--threads", "1", *map(str, flags)], None)
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines, self.port, self.terminated = [], None, False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        deadline = time.monotonic() + 120
        while self.port is None:
            assert time.monotonic() < deadline and self.proc.poll() is None, "\n".join(self.lines)
            time.sleep(0.05)
        while self.get("/ready")[0] != 200:
            assert time.monotonic() < deadline and self.proc.poll() is None, "\n".join(self.lines)
            time.sleep(0.05)

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if self.port is None and "listening on http://127.0.0.1:" in line:
                self.port = int(line.split("http://127.0.0.1:")[1].split()[0])

    def connection(self, timeout=60):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method, path, body=None, connection=None):
        """(status, headers, the JSON answer) of one request, on ``connection`` or a new one."""
        conn = connection or self.connection()
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), json.loads(response.read())
        finally:
            if connection is None:
                conn.close()

    def get(self, path):
        try:
            return self.request("GET", path)
        except OSError:
            return None, None, None

    def translate(self, payload, connection=None):
        return self.request("POST", "/translate", json.dumps(payload).encode(), connection)

    def terminate(self):
        """SIGTERM, once: a second one would stop it at once, as for any process."""
        if not self.terminated:
            self.terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout=60):
        """SIGTERM (unless sent already); the exit status."""
        self.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.reader.join(timeout=10)


@pytest.fixture(scope="module")
def server(bundle):
    live = LiveServer(bundle, "--max-lines", 50, "--max-body-bytes", 4096)
    yield live
    assert live.stop() == 0, "\n".join(live.lines[-20:])


def test_health_readiness_and_the_access_log(server):
    assert server.get("/health")[::2] == (200, {"status": "alive"})
    status, _, state = server.get("/ready")
    assert status == 200 and state["ready"] is True and {"waiting", "batches", "sentences"} <= state.keys()
    server.translate({"text": ["w1 w2", "w3"]})
    deadline = time.monotonic() + 10
    while not any('"POST /translate" 200 lines=2 ms=' in line for line in server.lines):
        assert time.monotonic() < deadline, server.lines[-5:]
        time.sleep(0.05)


def test_translations_are_the_commands(server, bundle, sentences, tmp_path):
    """One request of many sentences, one request per sentence, an empty sentence, n-best with
    scores, another beam size: as fairseq-rope-translate with the same flags."""
    chosen = list(sentences)[:40]
    expected = [sentences[s] for s in chosen]
    status, _, answer = server.translate({"text": chosen[:20] + [""] + chosen[20:]})
    assert status == 200 and answer == {"translations": expected[:20] + [""] + expected[20:]}
    assert [server.translate({"text": [s]})[2]["translations"] for s in chosen[:8]] == [[t] for t in expected[:8]]

    records = [json.loads(line) for line in translate_with_the_command(bundle, tmp_path, chosen, "--nbest", "3",
                                                                       "--json-lines")]
    status, _, answer = server.translate({"text": chosen, "nbest": 3, "scores": True})
    assert status == 200
    assert answer["translations"] == [[h["text"] for h in r["translations"]] for r in records]
    # scores to float rounding: another batch, another padding (the texts are identical)
    assert all(abs(a - h["score"]) < 1e-4 for scores, r in zip(answer["scores"], records)
               for a, h in zip(scores, r["translations"], strict=True))

    beam2 = translate_with_the_command(bundle, tmp_path, chosen, "--beam", "2")
    status, _, answer = server.translate({"text": chosen, "beam_size": 2, "scores": True})
    assert status == 200 and answer["translations"] == beam2 and all(isinstance(s, float) for s in answer["scores"])


TOO_LONG = " ".join(["w12"] * 14)  # 3 BPE tokens each: 42, beyond the model's 39


@pytest.mark.parametrize("body, status, message", [
    (b'{"text": ["w1 w2"', 400, "the request body is not JSON (Expecting ',' delimiter at line 1 column 18)"),
    (b'["w1"]', 400, "the request body is a list, not a JSON object"),
    (b'{"text": "w1 w2"}', 400, '"text" must be a list of strings, not a string'),
    (b'{"text": ["w1", 3]}', 400, '"text"[1] must be a string, not a number'),
    (b'{"txt": ["w1"]}', 400, 'unknown field "txt": a request has text, beam_size, nbest, scores'),
    (b'{"text": ["w1"], "beam_size": "4"}', 400, '"beam_size" must be an integer from 1 to 8 (--max-beam), not "4"'),
    (b'{"text": ["w1"], "beam_size": 2, "nbest": 3}', 400, '"nbest" must be an integer from 1 to 2 (the beam size)'),
    (b'{"text": ["w1"], "scores": 1}', 400, '"scores" must be true or false, not a number'),
    (b'{"text": ["w1 \xff w2"]}', 400, "the request body is not UTF-8: byte 0xff at offset 14"),
    (b'{"text": ["w1\\nw2"]}', 400, '"text"[0] holds a line break (U+000A): send each sentence as an item of its own'),
    (b'{"text": ["\\ud800"]}', 400, '"text"[0] holds an unpaired surrogate'),
    (json.dumps({"text": ["w1"] * 51}).encode(), 413, "51 sentences in one request; the server takes at most 50 "
                                                       "(--max-lines): split the request"),
    (json.dumps({"text": ["w1", TOO_LONG]}).encode(), 413, '"text"[1] is 42 BPE tokens long; the model takes at most '
                                                            "39 (--max-source-positions): split the sentence"),
    (json.dumps({"text": ["w1 " * 1400]}).encode(), 413, "the request body is over 4096 bytes (--max-body-bytes)"),
], ids=["malformed JSON", "not an object", "text not a list", "a line not a string", "unknown field",
        "beam_size not an integer", "nbest over the beam", "scores not a boolean", "invalid UTF-8", "a line break",
        "a lone surrogate", "too many lines", "a line over the length limit", "a body over the size limit"])
def test_a_bad_request_is_a_4xx_with_a_one_line_json_error_and_the_server_goes_on(server, sentences, body, status,
                                                                                 message):
    conn = server.connection()
    try:
        conn.request("POST", "/translate", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
    finally:
        conn.close()
    assert response.status == status and list(answer) == ["error"], (response.status, answer)
    assert message in answer["error"] and "\n" not in answer["error"], answer
    sentence = next(iter(sentences))
    assert server.translate({"text": [sentence]})[::2] == (200, {"translations": [sentences[sentence]]})


def test_unknown_paths_and_methods_are_json_errors(server):
    assert server.get("/nope")[::2] == (404, {"error": "GET /nope: Not Found: the routes are GET /health, "
                                                       "GET /ready, GET /metrics and POST /translate"})
    assert server.get("/translate")[::2] == (405, {"error": "GET /translate: Method Not Allowed"})


def test_a_full_queue_answers_503_with_retry_after(bundle, sentences):
    """The queue holds 4 sentences; a batch waits 2 s for more: while 3 wait, a request of 2 more
    is refused at once, and the 3 are translated."""
    live = LiveServer(bundle, "--max-queue", 4, "--max-batch-wait", 2)
    try:
        chosen = list(sentences)[:5]
        first = {}
        waiting = threading.Thread(target=lambda: first.update(answer=live.translate({"text": chosen[:3]})))
        waiting.start()
        deadline = time.monotonic() + 30
        while live.get("/ready")[2]["waiting"] != 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        began = time.monotonic()
        status, headers, answer = live.translate({"text": chosen[3:]})
        assert time.monotonic() - began < 2  # refused at once, not queued
        assert status == 503 and headers["Retry-After"] == "1"
        assert answer == {"error": "the server is busy: 3 sentences are waiting; the queue holds at most 4: retry later"}
        waiting.join(timeout=60)
        assert first["answer"][::2] == (200, {"translations": [sentences[s] for s in chosen[:3]]})
        assert live.translate({"text": chosen[3:]})[::2] == (200, {"translations": [sentences[s] for s in chosen[3:]]})
    finally:
        assert live.stop() == 0, "\n".join(live.lines[-20:])


def test_32_concurrent_clients_each_get_their_own_translations(server, sentences):
    """32 clients at once, 3 requests each (2 sentences, then 1, then 2), every sentence a different
    one: each answer holds its own sentences' translations, in order; they were batched together."""
    chosen = list(sentences)[:32 * 5]
    plans = [[chosen[c * 5:c * 5 + 2], chosen[c * 5 + 2:c * 5 + 3], chosen[c * 5 + 3:c * 5 + 5]] for c in range(32)]
    answers = [[] for _ in plans]
    before = server.get("/ready")[2]
    start = threading.Barrier(32)

    def client(c):
        conn = server.connection()
        try:
            start.wait(timeout=30)
            for text in plans[c]:
                answers[c].append(server.translate({"text": text}, conn)[::2])
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    for plan, got in zip(plans, answers):
        assert got == [(200, {"translations": [sentences[s] for s in text]}) for text in plan]
    after = server.get("/ready")[2]
    sentences_decoded, batches = after["sentences"] - before["sentences"], after["batches"] - before["batches"]
    assert sentences_decoded == 32 * 5 and batches < 32 * 3  # requests shared batches


def test_sigterm_during_load_completes_every_request_in_flight(bundle, sentences):
    """32 clients send request after request; SIGTERM comes once 64 answers have: every request
    sent before it is answered -- translated, or 503 once the server stops taking requests --, the
    requests in flight at the signal are translated after it, the server's access log counts
    exactly the translations the clients got, and the server exits 0."""
    live = LiveServer(bundle)
    chosen = list(sentences)
    outcomes, lock = [], threading.Lock()
    answered = threading.Semaphore(0)

    def client(c):
        rng = random.Random(c)
        conn = live.connection(timeout=60)
        for _ in range(100):  # bounded: the signal comes after about 2 requests per client
            outcome = {"sentence": rng.choice(chosen), "sent": time.monotonic()}
            try:
                outcome["status"], _, outcome["answer"] = live.translate({"text": [outcome["sentence"]]}, conn)
            except (ConnectionError, http.client.HTTPException) as e:
                outcome["status"] = type(e).__name__
            outcome["received"] = time.monotonic()
            with lock:
                outcomes.append(outcome)
            answered.release()
            if outcome["status"] != 200:
                break
        conn.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(32)]
    for thread in threads:
        thread.start()
    for _ in range(64):
        assert answered.acquire(timeout=60)
    signalled = time.monotonic()
    live.terminate()
    for thread in threads:
        thread.join(timeout=90)
    assert not any(thread.is_alive() for thread in threads)
    assert live.stop(timeout=60) == 0, "\n".join(live.lines[-20:])

    translated = [o for o in outcomes if o["status"] == 200]
    assert all(o["answer"] == {"translations": [sentences[o["sentence"]]]} for o in translated)
    refused = [o for o in outcomes if o["status"] == 503]
    assert all(o["answer"]["error"].startswith("the server is shutting down") for o in refused)
    failed = [o for o in outcomes if o["status"] not in (200, 503)]
    assert {o["status"] for o in failed} <= {"ConnectionRefusedError", "RemoteDisconnected", "ConnectionResetError",
                                             "BrokenPipeError"}, failed
    assert all(o["sent"] >= signalled for o in failed), "a request sent before SIGTERM got no answer"
    log = live.lines
    assert sum('"POST /translate" 200 ' in line for line in log) == len(translated)
    in_flight = next(int(line.split("finishing ")[1].split()[0]) for line in log if "stopping: no new connections" in line)
    assert in_flight >= 1, log[-10:]
    assert sum(o["received"] > signalled for o in translated) >= in_flight
    assert any("stopped: " in line for line in log)


def test_the_load_benchmark_reports_the_server_against_the_batch_command(bundle, sentences, tmp_path):
    """fairseq-rope-benchmark-serve on 40 sentences at 1 and 4 clients: every server translation
    is the batch command's, and the report gives sentences/s, latencies and the share of the
    batch command's decoding-only and wall-time speed at each level."""
    source = tmp_path / "source.en"
    source.write_text("".join(s + "\n" for s in list(sentences)[:40]), encoding="utf-8")
    report_path = tmp_path / "report.json"
    run_cli(["fairseq-rope-benchmark-serve", "--model-dir", bundle, "--input", source, "-o", report_path,
             "--sentences", 40, "--clients", 1, 4, "--threads", 1], cwd=tmp_path, timeout=300)
    report = json.loads(report_path.read_text())
    assert report["sentences"] == 40 and report["batch_runs_identical"] is True
    assert [run["when"] for run in report["batch_command"]] == ["before the server", "after the server"]
    assert len(report["machine"]["load_average_before"]) == 3
    assert [row["clients"] for row in report["server"]] == [1, 4]
    for row in report["server"]:
        assert row["identical_to_batch_command"] == 40
        assert 0 < row["latency_p50_ms"] <= row["latency_p95_ms"]
        assert 0 < row["clients_cpu_seconds"]  # the load's own share of the cores, reported
        # the speeds are reported to 0.1 sentence/s: on a loaded machine (a few sentences/s) that
        # rounding alone moves their ratio by up to about 1 %
        assert row["share_of_batch_decoding"] == pytest.approx(
            row["sentences_per_second"] / report["batch_decoding_sentences_per_second"], rel=0.02)
        assert row["share_of_batch_wall"] == pytest.approx(
            row["sentences_per_second"] / report["batch_wall_sentences_per_second"], rel=0.02)
    assert report["server"][0]["mean_batch"] == 1.0  # one client: nothing to batch with


def test_the_load_benchmark_never_writes_over_its_input(bundle, tmp_path):
    source = tmp_path / "source.en"
    source.write_text("w1 w2\n", encoding="utf-8")
    proc = run_cli(["fairseq-rope-benchmark-serve", "--model-dir", bundle, "--input", source, "-o", source],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 2 and f"error: --output {source} is --input {source}" in proc.stderr
    assert source.read_text(encoding="utf-8") == "w1 w2\n"


def test_an_onnx_export_of_the_same_model_serves_as_translate_translates_with_it(bundle, sentences, tmp_path):
    """The engine comes from the bundle's manifest: the service opens ONNX Runtime for an ONNX export,
    and 16 concurrent clients get fairseq-rope-translate's translations and scores of that export,
    nearly all of them the CTranslate2 export's too (both are fairseq's search)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    info = read_export_info(bundle)
    onnx_bundle = tmp_path / "onnx"
    run_cli(["fairseq-rope-export", "--format", "onnx", "--checkpoint", info["checkpoint"], "--data-bin",
             info["data_bin"], "--output-dir", onnx_bundle])
    chosen = list(sentences)[:64]
    records = [json.loads(line) for line in translate_with_the_command(onnx_bundle, tmp_path, chosen, "--nbest", "2",
                                                                       "--json-lines")]
    best = [r["translations"][0]["text"] for r in records]
    assert sum(b == sentences[s] for b, s in zip(best, chosen)) >= 0.95 * len(chosen)
    live = LiveServer(onnx_bundle)
    try:
        assert any("(onnx on cpu" in line for line in live.lines), live.lines
        answers = [None] * 16

        def client(c):
            answers[c] = live.translate({"text": chosen[c * 4:c * 4 + 4], "nbest": 2, "scores": True})[::2]

        threads = [threading.Thread(target=client, args=(c,)) for c in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        for c, (status, answer) in enumerate(answers):
            expected = records[c * 4:c * 4 + 4]
            assert status == 200 and answer["translations"] == [[h["text"] for h in r["translations"]]
                                                                for r in expected]
            assert all(abs(a - h["score"]) < 1e-4 for scores, r in zip(answer["scores"], expected)
                       for a, h in zip(scores, r["translations"], strict=True))
    finally:
        assert live.stop() == 0, "\n".join(live.lines[-20:])

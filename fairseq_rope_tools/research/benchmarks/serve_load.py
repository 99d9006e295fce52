#!/usr/bin/env python3
"""fairseq-rope-serve under load, against fairseq-rope-translate on the same sentences.

    fairseq-rope-benchmark-serve --model-dir ct2/wmt14_en_de --input test.en -o serve_load.json \\
        [--sentences 1000] [--clients 1 8 32] [--threads 2] [--serve-args "--max-batch-wait 0.005"]

The first --sentences non-empty lines of --input are translated
* by the batch command, ``fairseq-rope-translate --model-dir B FILE -o OUT --threads T``, before
  and after the server runs (on a shared machine the speed drifts; both runs are reported): its
  own decoding time (sorting, segmentation, detokenisation and model loading excluded: the
  strictest comparison), and the whole command's wall time; the server's sentences/s are given
  as a share of each (the mean of the two runs);
* by ``fairseq-rope-serve --model-dir B --threads T``, started as a user starts it, at each
  --clients level: that many concurrent clients (one process, asyncio, keep-alive connections),
  each sending one sentence per request and the next as soon as its answer comes, until every
  sentence has been sent once. Sentences per second are the sentences over the time from the
  first request to the last answer; latency is each request's, from sending to its whole answer
  (p50, p95); the clients' own CPU time is reported with them (they share the server's cores).
  Before the first level a warm-up of 32 requests is not timed.

Every server translation is compared with the batch command's for the same sentence (they must
be identical), and the mean batch the server decoded at each level is read from its GET /ready
counters. The report (--output, JSON, written atomically) holds every figure, the machine (CPU,
cores, load average before and after) and the commands; a table goes to stderr. The server and
the load run on the same machine and share its cores.
"""

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fairseq_rope_base.files import output_files_problem, write_lines_atomically, write_text_atomically
from fairseq_rope_tools.cli import ArgumentParser, UserError, command, progress_sayer, run_logged
from fairseq_rope_tools.research.machine import cpu_model
from fairseq_rope_tools.text_lines import read_lines

progress = progress_sayer("benchmark-serve")
WARM_UP = 32
READY_TIMEOUT = 300.0  # seconds for the server to load the model


def percentile(values, q):
    """The ``q``-th percentile (0-100) of ``values``, linearly interpolated (numpy's default)."""
    import numpy

    return float(numpy.percentile(values, q))


def run_batch_command(model_dir, source, threads, work):
    """The batch command on ``source``: (translations, decoding seconds, wall seconds); its log in
    ``work``, a failure a CommandFailed naming its last lines."""
    out, stats = work / "batch.out", work / "batch.json"
    began = time.perf_counter()
    run_logged(["fairseq-rope-translate", "--model-dir", model_dir, source, "-o", out, "--threads", threads,
                "--stats-json", stats, "--quiet"], work / "batch.log")
    wall = time.perf_counter() - began
    return read_lines(out), json.loads(stats.read_text())["seconds"], wall


class ServerProcess:
    """``fairseq-rope-serve`` started with ``args`` on a free port of 127.0.0.1, its stderr in
    ``log``; ``port`` once it listens."""

    def __init__(self, args, log: Path):
        self.log_path = log
        self.cmd = [sys.executable, "-m", "fairseq_rope_tools.deploy.serve", "--host", "127.0.0.1", "--port", "0",
                    *args]
        self.log = open(log, "w", encoding="utf-8")
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        self.port = None

    def tail(self, lines=15):
        return "\n".join(self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])

    def wait_listening(self, timeout=READY_TIMEOUT):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
                if "listening on http://127.0.0.1:" in line:
                    self.port = int(line.split("http://127.0.0.1:")[1].split()[0])
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise UserError(f"fairseq-rope-serve did not start listening: its last lines:\n{self.tail()}", status=1)

    def stop(self, timeout=60):
        """SIGTERM, then its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            status = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            status = self.proc.wait()
        self.log.close()
        return status


async def get_json(session, url):
    async with session.get(url) as response:
        return response.status, await response.json()


async def wait_ready(session, base, server, timeout=READY_TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            break
        try:
            status, state = await get_json(session, f"{base}/ready")
            if status == 200:
                return state
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise UserError(f"fairseq-rope-serve did not become ready: its last lines:\n{server.tail()}", status=1)


async def load(session, base, sentences, clients):
    """Every sentence sent once, one per request, by ``clients`` concurrent clients: (the
    translations in order, each request's latency in seconds, seconds from the first request to
    the last answer, the clients' CPU seconds)."""
    translations = [None] * len(sentences)
    latencies = []
    next_index = iter(range(len(sentences)))

    async def client():
        for i in next_index:  # shared: each sentence goes to the first client that is free
            began = time.perf_counter()
            async with session.post(f"{base}/translate", json={"text": [sentences[i]]}) as response:
                answer = await response.json()
                if response.status != 200:
                    raise UserError(f"fairseq-rope-serve answered {response.status} to sentence {i + 1}: "
                                    f"{answer.get('error')}", status=1)
            latencies.append(time.perf_counter() - began)
            translations[i] = answer["translations"][0]

    began, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client() for _ in range(clients)))
    return translations, latencies, time.perf_counter() - began, time.process_time() - cpu


async def measure_server(server, sentences, levels, expected):
    import aiohttp

    base = f"http://127.0.0.1:{server.port}"
    rows = []
    connector = aiohttp.TCPConnector(limit=max(levels))
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        await wait_ready(session, base, server)
        await load(session, base, sentences[:WARM_UP], min(WARM_UP, max(levels)))
        for clients in levels:
            progress(f"{clients} concurrent client{'s' if clients != 1 else ''}, one sentence per request")
            _, before = await get_json(session, f"{base}/ready")
            translations, latencies, seconds, cpu = await load(session, base, sentences, clients)
            _, after = await get_json(session, f"{base}/ready")
            batches, decoded = after["batches"] - before["batches"], after["sentences"] - before["sentences"]
            rows.append(dict(clients=clients, seconds=round(seconds, 3),
                             sentences_per_second=round(len(sentences) / seconds, 1),
                             latency_p50_ms=round(percentile(latencies, 50) * 1000, 1),
                             latency_p95_ms=round(percentile(latencies, 95) * 1000, 1),
                             mean_batch=round(decoded / batches, 2) if batches else None,
                             clients_cpu_seconds=round(cpu, 3),
                             identical_to_batch_command=sum(t == e for t, e in zip(translations, expected))))
    return rows


@command
def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="a bundle written by fairseq-rope-export")
    p.add_argument("--input", required=True, help="raw text, one sentence per line (its first --sentences are used)")
    p.add_argument("-o", "--output", required=True, help="the JSON report")
    p.add_argument("--sentences", type=int, default=1000, help="non-empty lines of --input to translate (1000)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32], help="concurrent clients per level (1 8 32)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of both commands (2)")
    p.add_argument("--serve-args", default="", help="more flags for fairseq-rope-serve, as one shell-quoted string")
    args = p.parse_args(argv)
    if args.sentences < 1 or args.threads < 1 or min(args.clients) < 1:
        p.error("--sentences, --threads and --clients must be at least 1")
    problem = output_files_problem({"--output": args.output}, {"--model-dir": args.model_dir, "--input": args.input})
    if problem:
        raise UserError(problem)
    if not Path(args.model_dir).is_dir():
        raise UserError(f"--model-dir {args.model_dir} is not a directory")
    sentences = [line for line in read_lines(args.input) if line.strip()][:args.sentences]
    if not sentences:
        raise UserError(f"--input {args.input} holds no sentence")
    serve_flags = ["--model-dir", args.model_dir, "--threads", str(args.threads), *shlex.split(args.serve_args)]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="benchmark-serve.") as work:
        work = Path(work)
        source = work / "source.txt"
        write_lines_atomically(source, sentences)
        batch = []
        progress(f"batch command on {len(sentences)} sentences, {args.threads} thread(s)")
        expected, decoding, wall = run_batch_command(args.model_dir, source, args.threads, work)
        batch.append(dict(when="before the server", decoding_seconds=decoding, wall_seconds=round(wall, 3)))
        progress("starting fairseq-rope-serve " + " ".join(map(shlex.quote, serve_flags)))
        server = ServerProcess(serve_flags, work / "serve.log")
        try:
            server.wait_listening()
            rows = asyncio.run(measure_server(server, sentences, args.clients, expected))
        finally:
            status = server.stop()
        if status != 0:
            raise UserError(f"fairseq-rope-serve exited with status {status} after SIGTERM: its last lines:\n"
                            f"{server.tail()}", status=1)
        progress("batch command again")
        again, decoding, wall = run_batch_command(args.model_dir, source, args.threads, work)
        batch.append(dict(when="after the server", decoding_seconds=decoding, wall_seconds=round(wall, 3)))
    for run in batch:
        run["decoding_sentences_per_second"] = round(len(sentences) / run["decoding_seconds"], 1)
        run["wall_sentences_per_second"] = round(len(sentences) / run["wall_seconds"], 1)
    # two references: the decoding alone (the strictest), and the whole command as a user times it
    decoding_reference = statistics.mean(run["decoding_sentences_per_second"] for run in batch)
    wall_reference = statistics.mean(run["wall_sentences_per_second"] for run in batch)
    for row in rows:
        row["share_of_batch_decoding"] = round(row["sentences_per_second"] / decoding_reference, 3)
        row["share_of_batch_wall"] = round(row["sentences_per_second"] / wall_reference, 3)
    report = dict(
        model_dir=str(args.model_dir), input=str(args.input), sentences=len(sentences), threads=args.threads,
        command=" ".join(map(shlex.quote, ["fairseq-rope-benchmark-serve", *(sys.argv[1:] if argv is None else argv)])),
        serve_command=" ".join(map(shlex.quote, ["fairseq-rope-serve", *serve_flags])),
        machine=dict(cpu=cpu_model(), cores=os.cpu_count(), load_average_before=[round(x, 2) for x in load_before],
                     load_average_after=[round(x, 2) for x in os.getloadavg()]),
        batch_command=batch, batch_runs_identical=again == expected,
        batch_decoding_sentences_per_second=round(decoding_reference, 1),
        batch_wall_sentences_per_second=round(wall_reference, 1), server=rows)
    write_text_atomically(args.output, json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    for run in batch:
        progress(f"batch command ({run['when']}): {run['decoding_sentences_per_second']} sentences/s of decoding, "
                 f"{run['wall_sentences_per_second']} sentences/s in all")
    for row in rows:
        progress(f"{row['clients']:>3} clients: {row['sentences_per_second']} sentences/s "
                 f"({row['share_of_batch_decoding']:.0%} of the batch command's decoding, "
                 f"{row['share_of_batch_wall']:.0%} of its wall time), p50 "
                 f"{row['latency_p50_ms']} ms, p95 {row['latency_p95_ms']} ms, mean batch {row['mean_batch']}, "
                 f"{row['identical_to_batch_command']}/{len(sentences)} identical; the clients took "
                 f"{row['clients_cpu_seconds']} s of CPU in {row['seconds']} s")
    progress(f"wrote {args.output}")


if __name__ == "__main__":
    main()

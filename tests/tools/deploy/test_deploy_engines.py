"""The deploy code's seam, in-process with stand-in engines: the batching driver keeps input order
and batches one engine group at a time, the length-bucket router holds one bucket's model at a
time (every one it used when streaming), lines from a stream are batched as they come (a batch
leaves when full or a short wait after its first line, not at the end of the input), the
too-long policy counts what it skips or truncates, and the output formats (n-best text, JSON
lines with scores)."""

import json
import os
import threading
import time
from unittest import mock

import pytest

from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy import length_buckets
from fairseq_rope_tools.deploy.batching import LengthLimit, batches_as_they_come, translate_sorted
from fairseq_rope_tools.deploy.engine import Engine, Hypothesis
from fairseq_rope_tools.deploy.output import OutputFormat


class Reverser(Engine):
    """Translates a source into its tokens reversed, and n-1 worse variants; records its batches."""

    name = "reverser"

    def __init__(self, nbest=1, groups=None):
        self.nbest, self.groups, self.batches = nbest, groups or (lambda source: 0), []

    def group(self, source):
        return self.groups(source)

    def translate(self, batch):
        self.batches.append([list(s) for s in batch])
        return [[Hypothesis(s[::-1] + ["x"] * k, -1.0 - k) for k in range(self.nbest)] for s in batch]


def test_translate_sorted_keeps_input_order_and_gives_empty_and_skipped_sources_nothing():
    sources = [["a", "b", "c"], [], ["d"], None, ["e", "f"], ["g"] * 5]
    engine = Reverser()
    results, seconds = translate_sorted(engine, sources, batch_size=2)
    assert [[h.tokens for h in r] for r in results] == [[["c", "b", "a"]], [], [["d"]], [], [["f", "e"]], [["g"] * 5]]
    assert engine.batches == [[["d"], ["e", "f"]], [["a", "b", "c"], ["g"] * 5]]  # sorted by length
    assert seconds >= 0


def test_a_batch_holds_one_group_and_every_source_is_translated():
    """The router's groups: sorted by group first, and no batch mixes two (each bucket's model
    translates only its own sentences), whatever the batch size."""
    sources = [["w"] * n for n in (7, 1, 6, 2, 5, 3, 4, 8, 9)]
    for batch_size in (1, 2, 3, 4, 100):
        engine = Reverser(groups=lambda source: len(source) // 4)
        results, _ = translate_sorted(engine, sources, batch_size)
        assert [r[0].tokens for r in results] == sources  # all of them, in order
        for batch in engine.batches:
            assert len(batch) <= batch_size and len({len(s) // 4 for s in batch}) == 1
        assert [len(s) // 4 for batch in engine.batches for s in batch] == sorted(len(s) // 4 for s in sources)


class FakeBucketModel(Engine):
    loaded = []

    def __init__(self, directory):
        self.directory = directory
        self.max_source = 64
        FakeBucketModel.loaded.append(directory.name)

    def translate(self, batch):
        return [[Hypothesis([self.directory.name], 0.0)] for _ in batch]


@pytest.mark.parametrize("keep_loaded, loads", [(False, ["plain", "yarn_x2", "plain", "yarn_x2"]),
                                                (True, ["plain", "yarn_x2"])])
def test_the_router_sends_each_sentence_to_its_bucket_holding_one_model_unless_streaming(tmp_path, monkeypatch,
                                                                                         keep_loaded, loads):
    monkeypatch.setattr(length_buckets, "verified_bucket_manifest", lambda directory: {
        "training_length": 4, "buckets": [{"factor": 1.0, "directory": "plain"}, {"factor": 2.0, "directory": "yarn_x2"}]})
    FakeBucketModel.loaded = []
    router = length_buckets.LengthBuckets(tmp_path, FakeBucketModel, keep_loaded=keep_loaded)
    short, long = ["w"] * 2, ["w"] * 6  # 3 and 7 positions with </s>: within L = 4, and 1.75 L
    assert router.translate([short, long, short]) == [[Hypothesis(["plain"], 0.0)], [Hypothesis(["yarn_x2"], 0.0)],
                                                      [Hypothesis(["plain"], 0.0)]]
    router.translate([long, short])
    assert FakeBucketModel.loaded == loads and len(router.loaded) == (2 if keep_loaded else 1)
    assert router.report() == {"length_buckets": {"training_length": 4, "sentences": {"plain": 3, "yarn x2": 2}}}
    assert router.summary() == "length buckets (L = 4 tokens): plain 3, yarn x2 2"


class SlowLines:
    """Lines that arrive over time, as from a pipe: each (delay, line) after its delay; the
    generator ends (stdin closed) only when ``closed`` is set."""

    def __init__(self, timed_lines):
        self.timed_lines, self.closed = timed_lines, threading.Event()

    def __iter__(self):
        for delay, line in self.timed_lines:
            time.sleep(delay)
            yield line
        self.closed.wait()


def test_a_stream_is_batched_as_lines_come_without_waiting_for_its_end():
    lines = SlowLines([(0, "a"), (0, "b"), (0, "c"), (1.0, "d")])
    batches = batches_as_they_come(lines, batch_size=2, wait=0.05)
    started = time.monotonic()
    assert next(batches) == [(1, "a"), (2, "b")]  # full: at once
    assert next(batches) == [(3, "c")]  # the wait after its first line: before "d" comes
    assert time.monotonic() - started < 0.8
    assert next(batches) == [(4, "d")]  # while the input is still open
    assert not lines.closed.is_set()
    lines.closed.set()
    assert list(batches) == []


def test_a_read_error_comes_after_the_lines_before_it():
    def lines():
        yield "a"
        raise UserError("standard input: line 2: invalid UTF-8", status=1)

    batches = batches_as_they_come(lines(), batch_size=10, wait=5)
    assert next(batches) == [(1, "a")]
    with pytest.raises(UserError, match="line 2: invalid UTF-8"):
        next(batches)


def test_the_too_long_policy():
    tokens = ["w"] * 5
    with pytest.raises(UserError, match=r"^in.txt: line 3 has 5 BPE tokens; the model takes at most 4: .*"
                                        r"--max-source-positions, or pass --too-long split, skip or truncate") as refused:
        LengthLimit(5, "refuse", "in.txt").apply(3, tokens)
    assert refused.value.status == 1
    for policy, expected in (("skip", None), ("truncate", ["w"] * 4)):
        limit = LengthLimit(5, policy, "in.txt")
        assert limit.apply(1, ["w"] * 4) == ["w"] * 4 and limit.report() is None  # 4 tokens and </s> fit
        assert limit.apply(2, tokens) == expected and limit.apply(7, tokens) == expected
        assert limit.stats() == {"policy": policy, "limit": 5, "lines": 2, "first_line": 2}
        assert limit.report().startswith("in.txt: 2 lines longer than the model takes (4 BPE tokens) ")
    assert LengthLimit(None, "refuse", "in.txt").apply(1, ["w"] * 10000) == ["w"] * 10000


def test_nbest_output_formats():
    results = [[Hypothesis(["Der", "Hun@@", "d"], -0.5), Hypothesis(["Ein", "Hund"], -0.75)], [], []]
    notes = [None, None, "skipped"]
    text = OutputFormat("tok", 2, False, "subword_nmt", "de").lines([1, 2, 3], results, notes)
    assert text == ["Der Hund", "Ein Hund", "", "", "", ""]  # two lines per input line, always
    records = [json.loads(line) for line in OutputFormat("bpe", 2, True, "subword_nmt", "de").lines(
        [1, 2, 3], results, notes)]
    assert records == [{"line": 1, "translations": [{"text": "Der Hun@@ d", "score": -0.5},
                                                    {"text": "Ein Hund", "score": -0.75}]},
                       {"line": 2, "translations": []}, {"line": 3, "translations": [], "skipped": "too long"}]


def test_the_model_setup_is_returned_and_the_flags_stay_as_given(tmp_path):
    """check_model reads the parsed flags and returns what it found (ModelSetup); the flags are
    left as the user gave them."""
    from fairseq_rope_tools.deploy import model_setup, translate

    data_bin = tmp_path / "data-bin"
    data_bin.mkdir()
    for lang in ("en", "de"):
        (data_bin / f"dict.{lang}.txt").write_text("a 1\n", encoding="utf-8")
    (data_bin / "bpe_type").write_text("subword_nmt\n", encoding="utf-8")
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"weights")  # only its existence is checked before loading
    args = translate.parse_args(["--engine", "fairseq", "--checkpoint", str(checkpoint), "--data-bin", str(data_bin),
                                 "--src", "en", "--tgt", "de", "--input-format", "bpe", str(tmp_path / "in.txt")])
    given = dict(vars(args))
    setup = model_setup.check_model(args, args.engine, args.input_format, args.output_format)
    assert vars(args) == given
    assert setup == model_setup.ModelSetup("fairseq", output_format="detok", input_format="bpe",
                                           checkpoint=str(checkpoint), data_bin=data_bin, src="en", tgt="de",
                                           bpe_type="subword_nmt")


def test_one_thread_by_default_and_short_openmp_spinning_for_more():
    """--threads defaults to 1 (or $OMP_NUM_THREADS); for more, OpenMP threads spin briefly before
    they sleep unless the user chose how they wait (docs/deploy.md, threads on a shared host)."""
    from fairseq_rope_tools.deploy import engine, model_setup

    # patch.dict restores the whole environment, including what limit_openmp_spinning sets itself
    with mock.patch.dict(os.environ):
        for name in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
            os.environ.pop(name, None)
        assert model_setup.default_threads() == 1
        os.environ["OMP_NUM_THREADS"] = "3"
        assert model_setup.default_threads() == 3
        engine.limit_openmp_spinning(1)
        assert "GOMP_SPINCOUNT" not in os.environ
        engine.limit_openmp_spinning(2)
        assert os.environ["GOMP_SPINCOUNT"] == engine.GOMP_SPINCOUNT
        os.environ["GOMP_SPINCOUNT"] = "50"
        engine.limit_openmp_spinning(4)
        assert os.environ["GOMP_SPINCOUNT"] == "50"
        del os.environ["GOMP_SPINCOUNT"]
        os.environ["OMP_WAIT_POLICY"] = "active"
        engine.limit_openmp_spinning(4)
        assert "GOMP_SPINCOUNT" not in os.environ

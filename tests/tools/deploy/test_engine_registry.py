"""The registry of engines (fairseq_rope_tools/deploy/engines.py), in-process with an engine
declared only here: registered, it is one of fairseq-rope-translate's --engine choices and the
default for a bundle that declares its model format, checked and opened as the built-in ones are,
and served by fairseq-rope-serve; a bundle engine refuses a bundle of another format; unregistered
once the test ends, it is no choice at all."""

import json

import pytest
from support.commands import translate_in_process
from test_bundle import prepared_work_dir

from fairseq_rope_tools.deploy import engines, exported, model_setup, work_dir
from fairseq_rope_tools.deploy.engine import Engine, Hypothesis

#: the model format of the stand-in engine's bundles, as their bundle.json declares it
REVERSED = "reversed-tokens"


class ReversingEngine(Engine):
    """Translates each source into its tokens reversed."""

    name = "reverser"
    max_source = 64

    def translate(self, batch, decoding=None):
        return [[Hypothesis(source[::-1], -1.0)] for source in batch]


def open_reverser(setup, args, decoding, keep_loaded):
    opened.append((setup.model_dir, keep_loaded))
    return ReversingEngine()


opened = []  # (model_dir, keep_loaded) of every engine opened


@pytest.fixture
def reverser():
    """The stand-in engine, registered for the test only."""
    entry = engines.EngineEntry("reverser", "each source's tokens reversed", open_reverser, export_format=REVERSED)
    assert "reverser" not in [e.name for e in engines.registered_engines()]
    opened.clear()
    engines.register_engine(entry)
    try:
        yield entry
    finally:
        engines.unregister_engine(entry.name)
    assert entry not in engines.registered_engines()


@pytest.fixture
def reversal_bundle(tmp_path):
    """A bundle of the stand-in engine's format, with the segmentation of a prepared work dir."""
    segmentation = work_dir.segmentation_of(prepared_work_dir(tmp_path / "work"), "en", "de", "subword_nmt")
    out = tmp_path / "reversal"
    out.mkdir()
    (out / "reversal.json").write_text('{"direction": "backwards"}')
    manifest = exported.write_bundle(out, "en", "de", segmentation, model_format=REVERSED)
    assert manifest["model_format"] == REVERSED and exported.declared_model_format(out) == REVERSED
    return out


SOURCE, TRANSLATED = ["a b c", "", "x y"], ["c b a", "", "y x"]  # single letters: BPE leaves them whole


@pytest.mark.parametrize("chosen", [[], ["--engine", "reverser"]], ids=["by the bundle", "by --engine"])
def test_a_registered_engine_translates_chosen_by_its_bundle_or_by_engine(reverser, reversal_bundle, tmp_path,
                                                                          capsys, chosen):
    source, out, stats = tmp_path / "in.en", tmp_path / "out.de", tmp_path / "stats.json"
    source.write_text("".join(line + "\n" for line in SOURCE), encoding="utf-8")
    status, lines = translate_in_process(capsys, source, "--model-dir", reversal_bundle, "-o", out, "--stats-json",
                                         stats, *chosen)
    assert (status, lines) == (0, [])
    assert out.read_text(encoding="utf-8").split("\n")[:-1] == TRANSLATED
    assert json.loads(stats.read_text())["engine"] == "reverser"
    assert opened == [(str(reversal_bundle), False)]  # a file: sorted, not streamed


def test_a_bundle_engine_refuses_a_bundle_of_another_format(reverser, reversal_bundle, tmp_path, capsys):
    (tmp_path / "in.en").write_text("a\n")
    status, lines = translate_in_process(capsys, tmp_path / "in.en", "--model-dir", reversal_bundle, "--engine",
                                         "ctranslate2")
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].endswith(f"error: --model-dir {reversal_bundle} holds a model in the format {REVERSED} (its "
                             "bundle.json says so), which --engine ctranslate2 does not read: leave --engine out")
    assert opened == []


@pytest.mark.parametrize("chosen", [[], ["--engine", "reverser"]], ids=["by the bundle", "by --engine"])
def test_a_registered_bundle_engine_is_served(reverser, reversal_bundle, capsys, chosen):
    serve = pytest.importorskip("fairseq_rope_tools.deploy.serve")
    pytest.importorskip("aiohttp")
    from test_serve_requests import http, serve_until_done, wait_until

    args = serve.parse_args(["--model-dir", str(reversal_bundle), "--port", "0", "--threads", "1", *chosen])
    service = serve.Service(args, model_setup.check_served_model(args))
    server = serve.Server(service, "127.0.0.1", 0, shutdown_timeout=10)
    seen = {}

    def client():
        assert server.listening.wait(timeout=30)
        wait_until(lambda: http(server.port, "GET", "/ready")[0] == 200, "ready")
        seen["translate"] = http(server.port, "POST", "/translate", {"text": SOURCE})

    serve_until_done(server, client)
    assert seen["translate"][::2] == (200, {"translations": TRANSLATED})
    assert f"[serve] ready: --model-dir {reversal_bundle} (reverser on cpu, 1 thread, beam 4)" in capsys.readouterr().err
    assert opened == [(str(reversal_bundle), True)]  # requests come mixed: every model used stays loaded


def test_serve_takes_only_engines_that_read_a_bundle(reverser, capsys):
    serve = pytest.importorskip("fairseq_rope_tools.deploy.serve")
    assert serve.parse_args(["--model-dir", "m", "--engine", "reverser"]).engine == "reverser"
    with pytest.raises(SystemExit) as stopped:
        serve.parse_args(["--model-dir", "m", "--engine", "fairseq"])
    assert stopped.value.code == 2
    assert "argument --engine: invalid choice: 'fairseq' (choose from " in capsys.readouterr().err


def test_an_engine_name_or_bundle_format_is_one_engines():
    taken = engines.EngineEntry("ctranslate2", "another", open_reverser)
    with pytest.raises(ValueError, match="an engine named ctranslate2 is registered already"):
        engines.register_engine(taken)
    same_format = engines.EngineEntry("ct2-again", "another", open_reverser,
                                      export_format=exported.CTRANSLATE2_MODEL_FORMAT)
    with pytest.raises(ValueError, match="reads ctranslate2 bundles, as another engine does"):
        engines.register_engine(same_format)
    assert "ct2-again" not in [e.name for e in engines.registered_engines()]
    assert engines.registered_engines()[0].export_format == exported.CTRANSLATE2_MODEL_FORMAT  # still ctranslate2


def test_an_unregistered_engine_is_no_choice(tmp_path, capsys):
    (tmp_path / "in.en").write_text("a\n")
    status, lines = translate_in_process(capsys, tmp_path / "in.en", "--model-dir", tmp_path, "--engine", "reverser")
    assert status == 2 and "argument --engine: invalid choice: 'reverser' (choose from " in lines[-1]

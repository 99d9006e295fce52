"""fairseq-rope-export: the exported directory is a plain CTranslate2 model that
translates like fairseq-generate (RoPE in both layouts with partial rotation, linear scaling,
the sinusoidal baseline); a wrong rotary setting breaks that; unsupported models are refused
before anything is written."""

import json
import re

import pytest
from support.checkpoints import shared_tiny_model
from support.commands import fairseq_generate_test_set, run_cli, run_cli_streaming
from support.models import model_with_dictionary

from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy import checkpoint_export as exporter
from fairseq_rope_tools.deploy import ctranslate2_spec
from fairseq_rope_tools.deploy.exported import EXPORT_INFO

ctranslate2 = pytest.importorskip("ctranslate2")


EXPORT = "fairseq-rope-export"

MODELS = {  # name -> training flags (reversal needs positions: a wrong rotation shows)
    "rope": ["--arch", "transformer_rope_tiny"],
    "rope_half_partial": ["--arch", "transformer_rope_tiny", "--rope-layout", "half", "--rope-fraction", "0.5",
                          "--rope-theta", "500"],
    "sinusoidal": ["--arch", "transformer_tiny"],
}


@pytest.fixture(scope="module")
def trained(tiny_data_bin, tmp_path_factory):
    data_bin = tiny_data_bin / "data-bin"
    return data_bin, {name: shared_tiny_model(tmp_path_factory, data_bin, *flags) for name, flags in MODELS.items()}


def ct2_translate(model_dir, sources, beam):
    translator = ctranslate2.Translator(str(model_dir), device="cpu", intra_threads=1)
    results = translator.translate_batch(sources, beam_size=beam, length_penalty=0.6, max_decoding_length=256)
    return [r.hypotheses[0] for r in results]


def agreement(data_bin, checkpoint, model_dir, beam, *generate_extra, command=False):
    """Share of identical hypotheses, and corpus BLEU of each engine against the references
    (``command``: fairseq-generate run as a command, not in-process)."""
    from sacrebleu.metrics import BLEU

    fairseq = fairseq_generate_test_set(data_bin, checkpoint, beam, *generate_extra, command=command)
    ids = sorted(fairseq)
    ct2 = ct2_translate(model_dir, [fairseq[i][0] for i in ids], beam)
    same = sum(fairseq[i][1] == hyp for i, hyp in zip(ids, ct2)) / len(ids)
    refs = [[" ".join(fairseq[i][2]) for i in ids]]
    bleu = BLEU(tokenize="none")
    return (same, bleu.corpus_score([" ".join(fairseq[i][1]) for i in ids], refs).score,
            bleu.corpus_score([" ".join(h) for h in ct2], refs).score)


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(MODELS))
def test_exported_model_translates_like_fairseq_generate(trained, tmp_path, name):
    data_bin, checkpoints = trained
    out = tmp_path / "ct2"
    if name == "rope":  # the command lines once; the other models in-process (seconds faster)
        run_cli([EXPORT, "--checkpoint", checkpoints[name], "--data-bin", data_bin, "--output-dir", out])
    else:
        exporter.export(str(checkpoints[name]), str(data_bin), str(out))
    info = json.loads((out / EXPORT_INFO).read_text())
    assert info["checkpoint"] == str(checkpoints[name].resolve()) and info["quantization"] == "none"
    same, fairseq_bleu, ct2_bleu = agreement(data_bin, checkpoints[name], out, 1)
    assert same == 1.0  # greedy: token for token on every sentence
    same, fairseq_bleu, ct2_bleu = agreement(data_bin, checkpoints[name], out, 4, command=name == "rope")
    assert same >= 0.98 and abs(fairseq_bleu - ct2_bleu) <= 0.1, (same, fairseq_bleu, ct2_bleu)
    assert fairseq_bleu > 20  # a model that learned the task: a wrong rotation cannot go unseen


@pytest.mark.e2e
def test_linear_scaling_at_export_equals_the_generate_time_override(trained, tmp_path):
    data_bin, checkpoints = trained
    out = tmp_path / "ct2_linear"
    run_cli([EXPORT, "--checkpoint", checkpoints["rope"], "--data-bin", data_bin, "--output-dir", out,
             "--rope-scaling", "linear", "--rope-scaling-factor", "2"])
    override = ["--model-overrides", "{'rope_scaling': 'linear', 'rope_scaling_factor': 2.0}"]
    same, fairseq_bleu, ct2_bleu = agreement(data_bin, checkpoints["rope"], out, 1, *override)
    assert same == 1.0
    unscaled = fairseq_generate_test_set(data_bin, checkpoints["rope"], 1)
    scaled = fairseq_generate_test_set(data_bin, checkpoints["rope"], 1, *override)
    assert any(unscaled[i][1] != scaled[i][1] for i in unscaled)  # the scaling changes something


@pytest.mark.e2e
def test_yarn_with_partial_rotation_equals_the_generate_time_override(trained, tmp_path):
    """YaRN's temperature multiplies the whole query, rotated channels and the others: folded into
    the query and key projections, it is exported for --rope-fraction 0.5 too (CTranslate2's own
    sin/cos multiplier would reach the rotated channels only)."""
    data_bin, checkpoints = trained
    yarn = {"rope_scaling": "yarn", "rope_scaling_factor": 2.0, "rope_scaling_original_length": 8}
    out = exporter.export(str(checkpoints["rope_half_partial"]), str(data_bin), str(tmp_path / "yarn"), overrides=yarn)
    same, _, _ = agreement(data_bin, checkpoints["rope_half_partial"], out, 1, "--model-overrides", repr(yarn))
    assert same == 1.0


@pytest.mark.e2e
@pytest.mark.parametrize("wrong", [{"rotary_interleave": False}, {"rotary_base": 500.0}])
def test_a_wrong_rotary_setting_breaks_the_equivalence(trained, tmp_path, monkeypatch, wrong):
    data_bin, checkpoints = trained
    right = ctranslate2_spec.rotary_settings
    monkeypatch.setattr(ctranslate2_spec, "rotary_settings", lambda args, head_dim: {**right(args, head_dim), **wrong})
    out = exporter.export(str(checkpoints["rope"]), str(data_bin), str(tmp_path / "wrong"))
    same, _, _ = agreement(data_bin, checkpoints["rope"], out, 1)
    assert same < 0.9


@pytest.mark.e2e
def test_int8_export_is_smaller_and_still_translates(trained, tmp_path):
    """int8 changes the numbers, so only the model's competence is checked here; its BLEU on a
    real test set is measured by fairseq-rope-benchmark-ct2."""
    data_bin, checkpoints = trained
    exporter.export(str(checkpoints["rope"]), str(data_bin), str(tmp_path / "float32"))
    int8 = exporter.export(str(checkpoints["rope"]), str(data_bin), str(tmp_path / "int8"), quantization="int8")
    assert json.loads((tmp_path / "int8" / EXPORT_INFO).read_text())["quantization"] == "int8"
    assert (tmp_path / "int8" / "model.bin").stat().st_size < 0.5 * (tmp_path / "float32" / "model.bin").stat().st_size
    _, fairseq_bleu, int8_bleu = agreement(data_bin, checkpoints["rope"], int8, 4)
    assert int8_bleu > 20, (fairseq_bleu, int8_bleu)


@pytest.mark.parametrize("arch, flags, named", [
    ("transformer_rope_tiny", ["--rope-cross-attention"], "--rope-cross-attention"),
    ("transformer_rope_tiny", ["--rope-values"], "--rope-values"),
    ("transformer_rope_tiny", ["--attention-kind", "linear"], "--attention-kind linear"),
    ("transformer_rope_tiny", ["--rope-scaling", "ntk", "--rope-scaling-factor", "2"], "--rope-scaling ntk"),
    ("transformer_rope_tiny", ["--rope-scaling", "dynamic-yarn", "--rope-scaling-original-length", "20"],
     "--rope-scaling dynamic-yarn: the factor is chosen per sentence, and CTranslate2 has one rotary scaling for "
     "every sentence: export one static yarn per length bucket with --length-buckets"),
    ("transformer_rope_tiny", ["--encoder-normalize-before"], "--encoder-normalize-before"),
    ("transformer_rpe_tiny", [], "--arch transformer_rpe_tiny"),
    ("transformer_tiny", ["--no-token-positional-embeddings"], "--no-token-positional-embeddings"),
    ("transformer_tiny", ["--activation-fn", "tanh"], "--activation-fn tanh"),
])
def test_what_the_engine_cannot_compute_is_refused(arch, flags, named):
    _, _, args = model_with_dictionary(arch, *flags)
    with pytest.raises(UserError, match=re.escape(named)):
        ctranslate2_spec.check_exportable(args)


@pytest.mark.e2e
def test_refusal_is_one_line_and_writes_nothing(trained, tmp_path):
    data_bin, checkpoints = trained
    out = tmp_path / "refused"
    proc = run_cli([EXPORT, "--checkpoint", checkpoints["rope"], "--data-bin", data_bin,
                    "--output-dir", out, "--rope-scaling", "ntk", "--rope-scaling-factor", "2"], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("fairseq-rope-export: error: --rope-scaling ntk")
    assert list(tmp_path.iterdir()) == []
    # an existing output is kept unless --force
    out.mkdir()
    proc = run_cli([EXPORT, "--checkpoint", checkpoints["rope"], "--data-bin", data_bin,
                    "--output-dir", out], check=False)
    assert proc.returncode == 2 and "pass --force" in proc.stderr and list(out.iterdir()) == []


@pytest.mark.e2e
def test_benchmark_reports_every_engine_and_backend(trained, tmp_path):
    data_bin, checkpoints = trained
    lines = run_cli_streaming(["fairseq-rope-benchmark-ct2", "--checkpoint", checkpoints["rope"],
                               "--data-bin", data_bin, "--out-dir", tmp_path, "--threads", "1", "--reps", "1"])
    # a line as every configuration starts, while the benchmark runs: before its table, the first
    # one read before the command exited
    table = next(i for i, (line, _) in enumerate(lines) if line.startswith("| engine |"))
    reps = [(i, m[1]) for i, (line, _) in enumerate(lines)
            if (m := re.fullmatch(r"\[benchmark-ct2\] (.*: rep 1/1) \(\d+m\d\ds elapsed\)", line))]
    assert [rep for _, rep in reps] == [
        "fairseq-generate float32, 1 thread(s): rep 1/1", "ctranslate2 float32 MKL, 1 thread(s): rep 1/1",
        "ctranslate2 float32 CT2_USE_MKL=0, 1 thread(s): rep 1/1", "ctranslate2 int8 MKL, 1 thread(s): rep 1/1",
        "ctranslate2 int8 CT2_USE_MKL=0, 1 thread(s): rep 1/1", "onnx float32, 1 thread(s): rep 1/1"]
    assert lines[reps[0][0]][1] and reps[-1][0] < table
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["engine"], r["compute_type"], r["backend"]) for r in rows] == [
        ("fairseq-generate", "float32", ""), ("ctranslate2", "float32", "MKL"),
        ("ctranslate2", "float32", "CT2_USE_MKL=0"), ("ctranslate2", "int8", "MKL"), ("ctranslate2", "int8", "CT2_USE_MKL=0"),
        ("onnx", "float32", "")]
    fairseq = rows[0]
    assert fairseq["speedup"] == 1.0 and fairseq["identical_to_fairseq"] == fairseq["sentences"]
    for float32 in (rows[1], rows[-1]):  # CTranslate2's and ONNX Runtime's: fairseq's translations
        assert float32["identical_to_fairseq"] >= 0.98 * float32["sentences"]
        assert abs(float32["bleu"] - fairseq["bleu"]) <= 0.1
    assert "| ctranslate2 | int8 |" in (tmp_path / "results.md").read_text()


# --- fairseq-rope-benchmark-ct2: one error convention, no output over an input ---------------------
def test_a_failed_step_of_the_benchmark_is_a_user_error_with_status_1(monkeypatch):
    """The helpers raise (gpu_check.py calls them too); only the command's entry point exits."""
    import subprocess

    from fairseq_rope_tools.research.benchmarks import engine_timings as bench

    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="RuntimeError: boom\n")
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(UserError, match="^fairseq-generate failed:\nRuntimeError: boom") as raised:
        bench.fairseq_generate("checkpoint.pt", "data-bin", 1)
    assert raised.value.status == 1
    with pytest.raises(UserError, match=r"^ctranslate2 \(int8, CT2_USE_MKL=0\) failed") as raised:
        bench.engine_translate("ctranslate2", "ct2", "int8", 0, 1, [["w1"]])
    assert raised.value.status == 1


def test_the_benchmark_refuses_to_write_its_results_over_its_checkpoint(tmp_path, capsys, monkeypatch):
    from fairseq_rope_tools.research.benchmarks import ctranslate2_speed as bench

    checkpoint = tmp_path / "results.json"
    checkpoint.write_bytes(b"the checkpoint's bytes")
    (tmp_path / "data-bin").mkdir()
    monkeypatch.setattr(bench, "exported_model_dir", lambda *a: pytest.fail("the benchmark started"))
    with pytest.raises(SystemExit) as stopped:
        bench.main(["--checkpoint", str(checkpoint), "--data-bin", str(tmp_path / "data-bin"), "--out-dir",
                    str(tmp_path)])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1
    assert f"error: --out-dir's results.json {checkpoint} is --checkpoint {checkpoint}: the output would" in err
    assert checkpoint.read_bytes() == b"the checkpoint's bytes"

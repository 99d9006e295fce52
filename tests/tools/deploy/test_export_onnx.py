"""fairseq-rope-export --format onnx and the ONNX Runtime engine: every model it takes -- plain
RoPE, RoPE in the encoder-decoder attention with the half layout and partial rotation, every static
scaling, the sinusoidal baseline -- translates as fairseq-generate does (greedy on every sentence,
beam search on nearly every one, with its scores); what the graphs cannot compute is refused, every
reason at once, before anything is written."""

import hashlib
import json
import re

import pytest
from support.checkpoints import shared_tiny_model
from support.commands import fairseq_generate_test_set, run_cli, translate_in_process
from support.models import model_with_dictionary

from fairseq_rope_tools.cli import UserError
from fairseq_rope_tools.deploy import checkpoint_export as exporter
from fairseq_rope_tools.deploy.engine import Decoding
from fairseq_rope_tools.deploy.onnx_engine import OnnxEngine

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

EXPORT = "fairseq-rope-export"
MODELS = {  # name -> training flags (reversal needs positions: a wrong rotation shows)
    "rope": ["--arch", "transformer_rope_tiny"],
    "rope_cross_half_partial": ["--arch", "transformer_rope_tiny", "--rope-cross-attention", "--rope-layout", "half",
                                "--rope-fraction", "0.5", "--rope-theta", "500"],
    "sinusoidal": ["--arch", "transformer_tiny"],
}


@pytest.fixture(scope="module")
def trained(tiny_data_bin, tmp_path_factory):
    data_bin = tiny_data_bin / "data-bin"
    return data_bin, {name: shared_tiny_model(tmp_path_factory, data_bin, *flags) for name, flags in MODELS.items()}


def agreement(data_bin, checkpoint, model_dir, beam, *generate_extra, command=False):
    """Share of identical hypotheses, the largest score difference among them, and corpus BLEU of
    fairseq-generate and of the ONNX engine against the references."""
    from sacrebleu.metrics import BLEU

    fairseq = fairseq_generate_test_set(data_bin, checkpoint, beam, *generate_extra, command=command)
    ids = sorted(fairseq)
    sources, decoding = [fairseq[i][0] for i in ids], Decoding(beam, 0.6, 200, 1)
    onnx, two_threads = ([hypotheses[0] for hypotheses in
                          OnnxEngine(model_dir, decoding, threads=threads).translate(sources)] for threads in (1, 2))
    # two threads decode every other sentence each, side by side: the same hypotheses
    assert [h.tokens for h in two_threads] == [h.tokens for h in onnx]
    assert max(abs(a.score - b.score) for a, b in zip(onnx, two_threads)) < 1e-5
    same = [i for i, hypothesis in zip(ids, onnx) if hypothesis.tokens == fairseq[i][1]]
    score_gap = max(abs(h.score - fairseq[i][4]) for i, h in zip(ids, onnx) if i in same)
    refs = [[" ".join(fairseq[i][2]) for i in ids]]
    bleu = BLEU(tokenize="none")
    return (len(same) / len(ids), score_gap, bleu.corpus_score([" ".join(fairseq[i][1]) for i in ids], refs).score,
            bleu.corpus_score([" ".join(h.tokens) for h in onnx], refs).score)


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(MODELS))
def test_the_onnx_export_translates_like_fairseq_generate(trained, tmp_path, name):
    data_bin, checkpoints = trained
    out = tmp_path / "onnx"
    if name == "rope_cross_half_partial":  # the command once (a model CTranslate2 cannot take); others in-process
        proc = run_cli([EXPORT, "--format", "onnx", "--checkpoint", checkpoints[name], "--data-bin", data_bin,
                        "--output-dir", out])
        assert f"wrote {out.resolve()} (onnx)" in proc.stderr
    else:
        exporter.export(str(checkpoints[name]), str(data_bin), str(out), model_format="onnx")
    same, score_gap, fairseq_bleu, onnx_bleu = agreement(data_bin, checkpoints[name], out, 1)
    assert same == 1.0 and score_gap < 1e-4, (same, score_gap)  # greedy: token for token on every sentence
    same, score_gap, fairseq_bleu, onnx_bleu = agreement(data_bin, checkpoints[name], out, 4)
    assert same >= 0.98 and score_gap < 1e-4 and abs(fairseq_bleu - onnx_bleu) <= 0.1, (same, score_gap)
    assert fairseq_bleu > 20  # a model that learned the task: a wrong rotation cannot go unseen


@pytest.mark.e2e
@pytest.mark.parametrize("scaling", [  # every static scaling
    {"rope_scaling": "linear", "rope_scaling_factor": 2.0},
    {"rope_scaling": "ntk", "rope_scaling_factor": 4.0},
    {"rope_scaling": "yarn", "rope_scaling_factor": 2.0, "rope_scaling_original_length": 10},
], ids=lambda scaling: scaling["rope_scaling"])
def test_a_static_scaling_at_export_equals_the_generate_time_override(trained, tmp_path, scaling):
    data_bin, checkpoints = trained
    exporter.export(str(checkpoints["rope"]), str(data_bin), str(tmp_path / "scaled"), overrides=scaling,
                    model_format="onnx")
    same, score_gap, _, _ = agreement(data_bin, checkpoints["rope"], tmp_path / "scaled", 1, "--model-overrides",
                                      str(scaling))
    assert same == 1.0 and score_gap < 1e-4
    plain, _, _, _ = agreement(data_bin, checkpoints["rope"], tmp_path / "scaled", 1)
    assert plain < 1.0  # the scaling changed the translations: the comparison can tell


def test_what_the_graphs_cannot_compute_is_refused_every_reason_at_once():
    _, _, args = model_with_dictionary("transformer_rope_tiny", "--rope-values", "--rope-scaling", "dynamic-yarn",
                                       "--rope-scaling-original-length", "20")
    with pytest.raises(UserError) as refused:
        exporter.check_exportable_as("onnx", args)
    message = str(refused.value)
    assert message.startswith("cannot export to ONNX: ") and "\n" not in message
    assert "--rope-values" in message and "--rope-scaling dynamic-yarn" in message
    for arch, flags in (("transformer_rope_tiny", ["--rope-cross-attention", "--rope-layout", "half"]),
                        ("transformer_rope_tiny", ["--rope-scaling", "ntk", "--rope-scaling-factor", "2"]),
                        ("transformer_tiny", [])):
        exporter.check_exportable_as("onnx", model_with_dictionary(arch, *flags)[2])  # exported: no refusal
    _, _, args = model_with_dictionary("transformer_rpe_tiny")
    with pytest.raises(UserError, match="--arch transformer_rpe_tiny"):
        exporter.check_exportable_as("onnx", args)


@pytest.mark.parametrize("flags, named", [({"quantization": "int8"}, "--quantization int8"),
                                          ({"length_buckets": (2.0,)}, "--length-buckets")])
def test_what_the_onnx_export_does_not_write_is_refused(flags, named):
    with pytest.raises(UserError, match=re.escape(named)):
        exporter.check_format("onnx", **flags)


@pytest.mark.e2e
def test_a_refused_export_writes_nothing(trained, tmp_path):
    data_bin, checkpoints = trained
    out = tmp_path / "refused"
    proc = run_cli([EXPORT, "--format", "onnx", "--checkpoint", checkpoints["rope"], "--data-bin", data_bin,
                    "--output-dir", out, "--rope-scaling", "dynamic-yarn", "--rope-scaling-original-length", "10"],
                   check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "fairseq-rope-export: error: cannot export to ONNX: --rope-scaling dynamic-yarn")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e
def test_a_tampered_onnx_bundle_is_refused_in_one_line(trained, tmp_path, capsys):
    data_bin, checkpoints = trained
    out = tmp_path / "onnx"
    exporter.export(str(checkpoints["rope"]), str(data_bin), str(out), model_format="onnx")
    source = tmp_path / "in.en"
    source.write_text("1 2 3\n")
    flags = ("--model-dir", out, "--input-format", "bpe", "--output-format", "bpe", "-o", tmp_path / "out.de")
    assert translate_in_process(capsys, source, *flags)[0] == 0
    graph = (out / "decoder.onnx").read_bytes()
    (out / "decoder.onnx").write_bytes(graph[:-1] + bytes([graph[-1] ^ 1]))  # one bit: the manifest tells
    status, lines = translate_in_process(capsys, source, *flags)
    assert status == 2 and len(lines) == 1 and "decoder.onnx" in lines[0] and "export it again" in lines[0], lines
    # a graph replaced with its manifest made to match: ONNX Runtime's refusal, in one line
    (out / "decoder.onnx").write_bytes(b"not a graph")
    manifest = json.loads((out / "bundle.json").read_text())
    manifest["files"]["decoder.onnx"] = hashlib.sha256(b"not a graph").hexdigest()
    (out / "bundle.json").write_text(json.dumps(manifest))
    status, lines = translate_in_process(capsys, source, *flags)
    assert status == 2 and len(lines) == 1, lines
    error = lines[0].split(": error: ", 1)[1]
    assert error.startswith(f"--model-dir {out}: ONNX Runtime cannot load its graphs (") and error.endswith(
        "): export it again with fairseq-rope-export --format onnx"), error
    assert (tmp_path / "out.de").read_text().strip()  # the first run's output, untouched by the refusals


def test_the_benchmark_measures_the_onnx_engine_on_the_cpu_only(tmp_path, capsys):
    from fairseq_rope_tools.research.benchmarks import ctranslate2_speed as bench

    with pytest.raises(SystemExit) as stopped:
        bench.main(["--checkpoint", str(tmp_path / "c.pt"), "--data-bin", str(tmp_path), "--out-dir",
                    str(tmp_path / "out"), "--device", "cuda", "--engines", "ctranslate2", "onnx"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --engines onnx runs on the CPU: leave it out with --device cuda")

"""fairseq-rope-gpu-check, the one command for a CUDA machine, run here in its --tiny mode: every step
on the CPU with tiny sizes (the kernel under Triton's interpreter, fp32 training of both models on
the reversal corpus, generation, CTranslate2 float32 and int8). Checks the report's structure and
verdicts, and that without CUDA the command says so in one line. About 29 s on 2 idle cores (70 s
when other jobs share them), most of it the start-up of the six fairseq processes it runs; the
reversal corpus of conftest.py stands in for the quickstart one, whose preparation takes 15 s more."""

import json
import math

import pytest
from support.commands import run_cli

from fairseq_rope.modules.rotation_reference import kernel_error, rotation_from_definition, ulps_off
from fairseq_rope_tools.research.gpu_check import command as gpu_check
from fairseq_rope_tools.research.gpu_check import common as gpu_check_common
from fairseq_rope_tools.research.gpu_check import kernel as gpu_check_kernel
from fairseq_rope_tools.research.gpu_check import report as gpu_check_report
from fairseq_rope_tools.research.gpu_check import training as gpu_check_training

pytest.importorskip("ctranslate2")
pytest.importorskip("triton")
torch = pytest.importorskip("torch")

GPU_CHECK = "fairseq-rope-gpu-check"

SECTIONS = ("environment", "kernel", "training", "generation", "speed", "bandwidth", "ctranslate2", "onnx")


@pytest.fixture(scope="module")
def tiny_report(tiny_data_bin, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = run_cli([GPU_CHECK, "--tiny", "--out-dir", out, "--data-bin", tiny_data_bin / "data-bin",
                    "--threads", "1"], check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), out, tiny_data_bin


@pytest.mark.e2e
def test_every_section_is_reported(tiny_report):
    report, md, out, _ = tiny_report
    for key in SECTIONS:
        assert key in report and report[key].get("status") != "failed", (key, report.get(key))
    for _, title, _ in gpu_check_report.SECTIONS:
        assert f"\n## {title}\n" in md
    assert report["verdicts"] == {"kernel within tolerance": True, "RoPE fp16 loss within tolerance of fp32": None,
                                  "CTranslate2 float32 identical to fairseq": True,
                                  "ONNX Runtime float32 identical to fairseq": True, "every step ran": True}
    assert report["engines"] == ["ctranslate2", "onnx"]  # with --tiny, every exported engine by default
    env = report["environment"]
    assert env["device"] == "cpu" and env["torch"] == torch.__version__ and env["triton"] and env["ctranslate2"]
    assert (out / "losses.png").stat().st_size > 0


@pytest.mark.e2e
def test_kernel_ran_under_the_interpreter_within_the_tests_tolerances(tiny_report):
    kernel = tiny_report[0]["kernel"]
    assert kernel["backend"].startswith("Triton interpreter")
    assert set(kernel["dtypes"]) == {"float32", "float16", "bfloat16"}
    assert kernel["dtypes"]["float32"]["forward_abs"] <= 1e-6 and kernel["dtypes"]["float32"]["backward_abs"] <= 1e-6
    for half in ("float16", "bfloat16"):
        row = kernel["dtypes"][half]
        assert row["cases"] >= 2 and row["forward_ulps"] <= 1 and row["backward_ulps"] <= 1
    assert kernel["pass"] and all(row["pass"] for row in kernel["dtypes"].values())
    bandwidth = tiny_report[0]["bandwidth"]
    assert bandwidth["gb_per_s"] > 0 and bandwidth["peak_source"].startswith("measured")


@pytest.mark.e2e
def test_training_losses_are_finite_and_half_precisions_are_skipped(tiny_report):
    training = tiny_report[0]["training"]
    runs = training["runs"]
    for model in ("rope", "sinusoidal"):
        run = runs[f"{model} fp32"]
        assert run["status"] == "ok" and run["arch"] == gpu_check_common.TINY.archs[model]
        assert len(run["valid_curve"]) >= 2 and run["train_curve"][-1][0] == training["updates"]
        assert all(math.isfinite(loss) for _, loss, _ in run["valid_curve"])
        assert run["train_curve"][-1][1] < run["train_curve"][0][1]  # it learnt something
        assert runs[f"{model} fp16"]["status"] == gpu_check_training.FP16_SKIPPED
        assert runs[f"{model} bf16"]["status"] == gpu_check_training.BF16_SKIPPED
    assert training["fp16_verdict"]["pass"] is None
    assert "| rope fp32 | sinusoidal fp32 |" in tiny_report[1]


@pytest.mark.e2e
def test_speed_ratios_and_ctranslate2_identity(tiny_report):
    report, _, _, data = tiny_report
    test_sentences = sum(1 for _ in open(data / "test.en"))
    ratios = report["speed"]["rope_over_sinusoidal"]
    assert set(ratios) == {"training fp32 words/s", "training fp32 updates/s", "generation fp32 sentences/s"}
    assert all(r > 0 and math.isfinite(r) for r in ratios.values())
    assert set(report["generation"]["runs"]) == {"rope fp32", "sinusoidal fp32"}
    rows = {r["compute_type"]: r for r in report["ctranslate2"]["rows"]}
    assert set(rows) == {"float32", "int8"}
    assert rows["float32"]["sentences"] == rows["float32"]["identical"] == test_sentences
    assert rows["int8"]["weights"] == "int8" and rows["int8"]["sentences"] == test_sentences
    (onnx,) = report["onnx"]["rows"]  # the ONNX export, through the same worker and the engines' registry
    assert onnx["compute_type"] == "float32" and onnx["sentences"] == onnx["identical"] == test_sentences
    assert onnx["speedup"] > 0 and (tiny_report[2] / "work" / "ct2" / "onnx" / "bundle.json").is_file()


def test_the_onnx_engine_is_asked_for_only_where_it_decodes(tmp_path, capsys):
    """ONNX Runtime decodes on the CPU here: a GPU check leaves it out by default, and refuses it asked."""
    assert gpu_check.parse_args(["--out-dir", str(tmp_path / "a")]).engines == ["ctranslate2"]
    assert gpu_check.parse_args(["--out-dir", str(tmp_path / "b"), "--tiny", "--engines", "onnx"]).engines == ["onnx"]
    with pytest.raises(SystemExit) as exit:
        gpu_check.parse_args(["--out-dir", str(tmp_path / "c"), "--engines", "ctranslate2", "onnx"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --engines onnx decodes on the CPU only here: leave it out, or pass --tiny")
    # a report of a GPU check without ONNX has no ONNX section, not one "not reached yet"
    md = gpu_check_report.report_markdown({"tiny": False, "complete": True, "engines": ["ctranslate2"],
                                           "verdicts": {}})
    assert "## CTranslate2" in md and "## ONNX Runtime" not in md


def test_without_cuda_it_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # in this process: no second start-up
    with pytest.raises(SystemExit) as exit:
        gpu_check.main(["--out-dir", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert exit.value.code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and ": error: no CUDA device: " in err
    assert not (tmp_path / "out").exists()


def test_a_data_bin_inside_what_the_check_rewrites_is_refused(tmp_path, capsys):
    """Each run deletes OUT_DIR/work/runs/RUN before it trains: a --data-bin kept there would go."""
    data_bin = tmp_path / "out" / "work" / "runs" / "rope-fp32" / "data-bin"
    data_bin.mkdir(parents=True)
    (data_bin / "dict.en.txt").write_text("a 1\n")
    with pytest.raises(SystemExit) as exit:
        gpu_check.main(["--tiny", "--out-dir", str(tmp_path / "out"), "--data-bin", str(data_bin)])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "--out-dir's work/runs" in err and f"holds --data-bin {data_bin}" in err
    assert sorted(p.name for p in data_bin.iterdir()) == ["dict.en.txt"]


def test_ulps_and_peak_table():
    one = torch.tensor([1.0], dtype=torch.float16)
    assert ulps_off(one + torch.finfo(torch.float16).eps, one).item() == 1.0
    two = torch.tensor([2.0], dtype=torch.bfloat16)
    assert ulps_off(torch.tensor([3.0]), two).item() == 2 ** 7 / 2
    assert gpu_check_kernel.known_peak_bandwidth("NVIDIA H100 80GB HBM3") == (3350, "H100")
    assert gpu_check_kernel.known_peak_bandwidth("NVIDIA GH200 480GB")[0] == 4000
    assert gpu_check_kernel.known_peak_bandwidth("NVIDIA L40S")[0] == 864
    assert gpu_check_kernel.known_peak_bandwidth("NVIDIA L4")[0] == 300
    assert gpu_check_kernel.known_peak_bandwidth("NVIDIA A100-SXM4-40GB")[0] == 1555
    assert gpu_check_kernel.known_peak_bandwidth("Some Future GPU") == (None, None)


@pytest.mark.parametrize("layout", ("interleaved", "half"))
def test_cancelling_pairs_are_judged_against_fp32_arithmetic(layout):
    """An H200 found the kernel's bf16 rotation 32 ulps off: where x1 cos - x2 sin nearly cancels,
    fp32's own error is many bf16 ulps of the tiny result. The rotation computed in fp32 must pass;
    one moved 2 ulps where nothing cancels must fail."""
    g = torch.Generator().manual_seed(3)
    angles = torch.rand(4096, generator=g, dtype=torch.float64) * 6.28
    cos, sin = angles.cos().float(), angles.sin().float()
    scale = 1 + torch.rand(4096, generator=g, dtype=torch.float64) * 3
    # x = scale * (sin, cos): x1 cos - x2 sin = 0 up to bf16's rounding of x
    x1, x2 = (scale * angles.sin()).bfloat16(), (scale * angles.cos()).bfloat16()
    x = torch.stack((x1, x2), -1) if layout == "interleaved" else torch.stack((x1, x2), 0)
    x = x.reshape(1, 1, 1, -1)  # (T, B, H, D) with D = 8192 channels: 4096 pairs
    def split(t):
        t = t.reshape(-1)
        return (t[0::2], t[1::2]) if layout == "interleaved" else (t[:4096], t[4096:])

    def join(a, b):
        return (torch.stack((a, b), -1) if layout == "interleaved" else torch.cat((a, b))).reshape(x.shape)

    a, b = (v.float() for v in split(x))
    in_fp32 = join(a * cos - b * sin, b * cos + a * sin).bfloat16()
    reference = rotation_from_definition(x, cos, sin, layout)
    assert ulps_off(in_fp32, reference).max() > 1  # cancellation: the old one-ulp rule fails it
    assert kernel_error(in_fp32, x, cos, sin, layout)["pass"]
    moved = split(reference.clone())[0].abs().argmax()  # the largest result: nothing cancels there
    off = reference.clone().reshape(-1)
    index = 2 * moved if layout == "interleaved" else moved
    off[index] = torch.nextafter(torch.nextafter(off[index], off[index] * 4), off[index] * 4)
    result = kernel_error(off.reshape(x.shape), x, cos, sin, layout)
    assert not result["pass"] and result["ulps"] > 1.5, result


def test_a_failed_step_or_run_fails_the_verdicts():
    runs = {"rope fp32": {"status": "ok", "final_valid_loss": 4.0}, "rope fp16": {"status": "failed", "error": "x"}}
    report = {"kernel": {"pass": True}, "training": {"runs": runs, "fp16_verdict": gpu_check_training.loss_verdict(runs, 0.03)},
              "ctranslate2": {"float32_identical_verdict": True}}
    assert gpu_check_report.failed_steps(report) == ["rope fp16"]
    assert gpu_check_report.verdicts(report) == {
        "kernel within tolerance": True, "RoPE fp16 loss within tolerance of fp32": False,
        "CTranslate2 float32 identical to fairseq": True, "ONNX Runtime float32 identical to fairseq": None,
        "every step ran": False}
    # a check stopped midway: what it did not reach is "not run", not a failure
    partial = {"kernel": {"pass": True}, "training": {"runs": {}, "fp16_verdict": {"pass": True}}}
    assert gpu_check_report.verdicts(partial) == {
        "kernel within tolerance": True, "RoPE fp16 loss within tolerance of fp32": True,
        "CTranslate2 float32 identical to fairseq": None, "ONNX Runtime float32 identical to fairseq": None,
        "every step ran": None}
    assert gpu_check_report.verdicts({"kernel": {"status": "failed", "error": "x"}})["kernel within tolerance"] is False
    runs["rope fp16"] = {"status": "ok", "final_valid_loss": 4.2}
    assert gpu_check_training.loss_verdict(runs, 0.03)["pass"] is False and gpu_check_training.loss_verdict(runs, 0.06)["pass"] is True
    # the baseline's own fp16 loss sets the bar: 5 % is no RoPE problem where sinusoidal loses 4 %
    runs.update({"sinusoidal fp32": {"status": "ok", "final_valid_loss": 5.0},
                 "sinusoidal fp16": {"status": "ok", "final_valid_loss": 5.2}})
    verdict = gpu_check_training.loss_verdict(runs, 0.03)
    assert verdict["pass"] is True and verdict["allowed"] == 0.07 and verdict["sinusoidal_excess"] == 0.04
    runs["rope fp16"]["final_valid_loss"] = 4.3  # 7.5 %: above it
    assert gpu_check_training.loss_verdict(runs, 0.03)["pass"] is False
    runs["rope fp16"]["final_valid_loss"] = 3.5  # fp16 better than fp32: no fp16 problem
    assert gpu_check_training.loss_verdict(runs, 0.03)["pass"] is True


@pytest.mark.e2e
def test_a_report_written_midway_says_what_was_not_reached(tiny_report):
    """The report is rewritten after every step, so a check stopped midway (an H200 run cut at its
    time limit during CTranslate2) keeps what it found and says what it had not reached."""
    report = {key: value for key, value in tiny_report[0].items() if key not in ("generation", "speed", "ctranslate2")}
    report.update(complete=False, seconds=12.5)
    report["verdicts"] = gpu_check_report.verdicts(report)
    md = gpu_check_report.report_markdown(report)
    assert "**incomplete**: written 12.5 s into the check" in md
    assert md.count("not reached yet") == 3 and "| CTranslate2 float32 identical to fairseq | not run |" in md
    assert tiny_report[0]["complete"] is True and "incomplete" not in tiny_report[1]

"""End to end, as a user runs it: fairseq's own console scripts with --user-dir fairseq_rope."""

import filecmp
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.commands import REPO, run_cli

# every test runs fairseq's console scripts, most on a model a module fixture trains
pytestmark = pytest.mark.e2e

TRAIN_FLAGS = [
    "--arch", "transformer_rope_tiny", "--task", "translation", "--cpu",
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "3e-3",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "1500", "--seed", "1", "--log-format", "simple", "--log-interval", "10",
    "--save-interval-updates", "20", "--no-epoch-checkpoints",
    "--eval-bleu", "--eval-bleu-args", '{"beam": 1, "max_len_b": 20}',
    "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric",
    "--num-workers", "0",
]


def count_test_sentences(data_bin) -> int:
    # 43 in the fixture: not a multiple of fairseq's default --required-batch-size-multiple 8
    return sum(1 for _ in open(data_bin.parent / "test.en"))


def num_updates(log: str) -> int:
    return max(int(n) for n in re.findall(r"num_updates[ |:]+(\d+)", log))


@pytest.fixture(scope="module")
def trained(tiny_data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("checkpoints")
    proc = run_cli(["fairseq-train", tiny_data_bin / "data-bin", "--user-dir", "fairseq_rope",
                    "--save-dir", save_dir, "--max-update", "40", *TRAIN_FLAGS])
    return tiny_data_bin / "data-bin", save_dir, proc.stdout + proc.stderr


def test_training_decreases_loss_and_saves_checkpoints(trained):
    _, save_dir, log = trained
    losses = [float(x) for x in re.findall(r"valid on 'valid' subset \| loss ([\d.]+)", log)]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    assert "TransformerRopeModel" in log and "RotaryMultiheadAttention" in log
    for name in ("checkpoint_last.pt", "checkpoint_best.pt"):
        assert (save_dir / name).exists(), name
    assert len(list(save_dir.glob("checkpoint_*_20.pt"))) == 1  # --save-interval-updates


@pytest.mark.parametrize("checkpoint", ["checkpoint_best.pt", "checkpoint_last.pt", "checkpoint_*_20.pt"])
def test_generate_beam4_from_checkpoint(trained, checkpoint):
    data_bin, save_dir, _ = trained
    checkpoint = next(save_dir.glob(checkpoint)).name
    proc = run_cli(["fairseq-generate", data_bin, "--user-dir", "fairseq_rope", "--cpu",
                    "--path", save_dir / checkpoint, "--beam", "4", "--lenpen", "0.6",
                    "--batch-size", "16", "--gen-subset", "test"])
    hypotheses = [line for line in proc.stdout.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == count_test_sentences(data_bin)
    assert re.search(r"Generate test with beam=4: BLEU4 = [\d.]+", proc.stdout + proc.stderr)


def test_interactive(trained):
    data_bin, save_dir, _ = trained
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "fairseq-interactive"), str(data_bin),
         "--user-dir", "fairseq_rope", "--cpu", "--path", str(save_dir / "checkpoint_last.pt"),
         "--beam", "4", "--lenpen", "0.6", "--source-lang", "en", "--target-lang", "de"],
        input="w1 w2 w3\nw5 w6\n", capture_output=True, text=True, cwd=REPO, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(re.findall(r"^H-\d+\t", proc.stdout, flags=re.M)) == 2


def test_validate(trained):
    data_bin, save_dir, _ = trained
    proc = run_cli(["fairseq-validate", data_bin, "--user-dir", "fairseq_rope", "--cpu",
                    "--path", save_dir / "checkpoint_last.pt", "--task", "translation",
                    "--max-tokens", "2000", "--valid-subset", "valid"])
    assert re.search(r"valid on 'valid' subset \| loss [\d.]+", proc.stdout + proc.stderr)


def test_resume_from_checkpoint_last(trained, tmp_path):
    data_bin, save_dir, _ = trained
    resume_dir = tmp_path / "resume"
    resume_dir.mkdir()
    (resume_dir / "checkpoint_last.pt").write_bytes((save_dir / "checkpoint_last.pt").read_bytes())
    proc = run_cli(["fairseq-train", data_bin, "--user-dir", "fairseq_rope", "--save-dir", resume_dir,
                    "--max-update", "50", *TRAIN_FLAGS])
    log = proc.stdout + proc.stderr
    assert re.search(r"Loaded checkpoint .*checkpoint_last.pt \(epoch \d+ @ 40 updates\)", log), log[-3000:]
    assert num_updates(log) == 50


def test_works_from_any_directory_after_install(trained, tmp_path):
    """The documented `--user-dir "$(fairseq-rope-user-dir)"` names the installed plugin from any
    working directory (a second environment, regular and editable: test_install.py)."""
    installed = Path(run_cli(["fairseq-rope-user-dir"], cwd=tmp_path).stdout.strip())
    assert installed != REPO / "fairseq_rope" and installed.is_dir(), "fairseq_rope is not installed: run `make setup`"
    stale = filecmp.dircmp(REPO / "fairseq_rope", installed)
    assert not stale.diff_files, f"installed fairseq_rope is stale ({stale.diff_files}): run `make setup`"
    data_bin, save_dir, _ = trained
    proc = run_cli(["bash", "-c", 'fairseq-generate "$0" --user-dir "$(fairseq-rope-user-dir)" "$@"', data_bin, "--cpu",
                    "--path", save_dir / "checkpoint_last.pt", "--beam", "4", "--lenpen", "0.6",
                    "--batch-size", "16", "--max-sentences", "16"], cwd=tmp_path)
    assert sum(line.startswith("H-") for line in proc.stdout.splitlines()) == count_test_sentences(data_bin)


def test_hub_interface_translates(trained, tmp_path):
    data_bin, save_dir, _ = trained
    script = (
        "from fairseq.models.transformer import TransformerModel\n"
        "from fairseq_rope_tools.user_dir import plugin_dir\n"
        f"m = TransformerModel.from_pretrained({str(save_dir)!r}, checkpoint_file='checkpoint_last.pt',"
        f" data_name_or_path={str(data_bin)!r}, user_dir=plugin_dir(), beam=4, lenpen=0.6,"
        " source_lang='en', target_lang='de')\n"
        "print('MODEL', type(m.models[0]).__name__)\n"
        "print('OUT', m.translate('w1 w2 w3 w4'))\n"
    )
    proc = run_cli([sys.executable, "-c", script], cwd=tmp_path)
    assert "MODEL TransformerRopeModel" in proc.stdout
    out = re.search(r"^OUT (.*)$", proc.stdout, flags=re.M).group(1)
    assert out.strip() and all(re.fullmatch(r"w\d+", w) for w in out.split())


def test_checkpoints_load_with_torch_default_weights_only(trained):
    """The allow-list is what makes loading work: without importing fairseq_rope it fails."""
    _, save_dir, _ = trained
    load = "import torch; s = torch.load({!r}); print('BEST', s['extra_state']['best'])"
    for name in ("checkpoint_best.pt", "checkpoint_last.pt"):
        path = str(save_dir / name)
        ok = run_cli([sys.executable, "-c", "import fairseq_rope; " + load.format(path)])
        assert "BEST" in ok.stdout
        refused = run_cli([sys.executable, "-c", load.format(path)], check=False)
        assert refused.returncode != 0 and "weights_only" in refused.stderr.lower().replace(" ", "_")


def test_bad_flag_from_the_command_line(tiny_data_bin, tmp_path):
    proc = run_cli(["fairseq-train", tiny_data_bin / "data-bin", "--user-dir", "fairseq_rope",
                    "--save-dir", tmp_path, "--max-update", "1", "--rope-fraction", "0.3",
                    *TRAIN_FLAGS], check=False)
    assert proc.returncode != 0
    assert "--rope-fraction 0.3" in proc.stderr and "even" in proc.stderr


def test_without_the_plugin_fairseq_reads_the_checkpoint_far_enough_to_name_it(tiny_data_bin, tmp_path):
    """A checkpoint of a plugin architecture, read by fairseq-generate without --user-dir: not
    torch's UnpicklingError suggesting weights_only=False, but fairseq's own stop where it looks
    the architecture up, quoting what to pass; with --user-dir it decodes as any checkpoint."""
    from fairseq_rope.checkpoint_namespaces import NEEDS_THE_PLUGIN

    data_bin = tiny_data_bin / "data-bin"
    flags = [flag for flag in TRAIN_FLAGS[:TRAIN_FLAGS.index("--eval-bleu")]] + ["--num-workers", "0"]
    run_cli(["fairseq-train", data_bin, "--user-dir", "fairseq_rope", "--save-dir", tmp_path, "--max-update", "2",
             *flags])
    generate = ["fairseq-generate", data_bin, "--cpu", "--path", tmp_path / "checkpoint_last.pt", "--beam", "1",
                "--batch-size", "16", "--gen-subset", "test"]
    refused = run_cli(generate, check=False)
    assert refused.returncode != 0 and NEEDS_THE_PLUGIN in refused.stderr, refused.stderr[-3000:]
    assert "weights_only" not in refused.stderr and "Unpickling" not in refused.stderr
    decoded = run_cli(generate + ["--user-dir", "fairseq_rope"])
    assert sum(line.startswith("H-") for line in decoded.stdout.splitlines()) == count_test_sentences(data_bin)

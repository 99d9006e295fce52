"""Bring your own model: a sinusoidal fairseq Transformer, trained by stock fairseq without the
plugin and put in fairseq's pretrained-model layout (model.pt beside its dictionaries), starts a
RoPE model through stock fairseq-train --finetune-from-model. The weights are taken (the first loss
is far below a fresh model's), what has no counterpart is dropped and named once, the new
checkpoints record where they came from -- through resumes, averaging and export -- and every
start that cannot map one to one is refused in one line that lists each difference."""

import json
import re
import shutil

import pytest
import torch
from support.commands import run_cli

from fairseq_rope.initialization import ORIGIN, drop_token_positions

pytestmark = pytest.mark.e2e  # trains models with fairseq's console scripts

COMMON = ["--task", "translation", "--cpu", "--optimizer", "adam", "--lr", "3e-3", "--max-tokens", "1500",
          "--criterion", "label_smoothed_cross_entropy", "--seed", "1", "--no-epoch-checkpoints",
          "--disable-validation", "--num-workers", "0", "--log-format", "simple", "--log-interval", "1"]


def first_loss(log: str) -> float:
    return float(re.search(r"\| loss ([\d.]+) \|", log).group(1))


@pytest.fixture(scope="module")
def pretrained(tiny_data_bin, tmp_path_factory):
    """A stock transformer_tiny (sinusoidal, no plugin) of 60 updates, in fairseq's pretrained layout."""
    root = tmp_path_factory.mktemp("pretrained")
    data_bin = tiny_data_bin / "data-bin"
    run_cli(["fairseq-train", data_bin, "--arch", "transformer_tiny", "--save-dir", root / "train",
             "--max-update", "60", *COMMON])
    layout = root / "wmt_model"
    layout.mkdir()
    shutil.copy(root / "train" / "checkpoint_last.pt", layout / "model.pt")
    for lang in ("en", "de"):
        shutil.copy(data_bin / f"dict.{lang}.txt", layout / f"dict.{lang}.txt")
    return data_bin, layout


def fine_tune(data_bin, start, save_dir, *flags, updates=4, check=True):
    return run_cli(["fairseq-train", data_bin, "--user-dir", "fairseq_rope", "--arch", "transformer_rope_tiny",
                    "--finetune-from-model", start, "--save-dir", save_dir, "--max-update", str(updates), *COMMON,
                    *map(str, flags)], check=check)


def saved_options(path):
    return torch.load(path, map_location="cpu")["cfg"]["model"]


def test_a_stock_sinusoidal_model_starts_rope_with_cross_attention(pretrained, tmp_path):
    data_bin, layout = pretrained
    proc = fine_tune(data_bin, layout / "model.pt", tmp_path / "tuned", "--rope-cross-attention")
    log = proc.stdout + proc.stderr
    assert f"starting transformer_rope_tiny from {layout / 'model.pt'} (transformer_tiny)" in log, log[-3000:]
    fresh = run_cli(["fairseq-train", data_bin, "--user-dir", "fairseq_rope", "--arch", "transformer_rope_tiny",
                     "--rope-cross-attention", "--save-dir", tmp_path / "fresh", "--max-update", "1", *COMMON])
    # the weights came with it: its first loss is that of a trained model, not of a fresh one
    assert first_loss(log) < first_loss(fresh.stdout + fresh.stderr) - 1.0
    origin = saved_options(tmp_path / "tuned" / "checkpoint_last.pt")[ORIGIN]
    digest = __import__("hashlib").sha256((layout / "model.pt").read_bytes()).hexdigest()
    assert origin == {"path": str(layout / "model.pt"), "sha256": digest, "arch": "transformer_tiny"}

    # its resume is checked as any resume, and keeps the record
    fine_tune(data_bin, layout / "model.pt", tmp_path / "tuned", "--rope-cross-attention", updates=6)
    assert saved_options(tmp_path / "tuned" / "checkpoint_last.pt")[ORIGIN] == origin
    refused = fine_tune(data_bin, layout / "model.pt", tmp_path / "tuned", updates=8, check=False)
    assert refused.returncode != 0 and "--rope-cross-attention" in refused.stderr.strip().splitlines()[-1]


def test_the_fine_tuned_model_averages_exports_and_translates_with_its_origin(pretrained, tmp_path):
    data_bin, layout = pretrained
    fine_tune(data_bin, layout / "model.pt", tmp_path / "tuned", "--save-interval-updates", "2",
              "--keep-interval-updates", "3")
    run_cli(["fairseq-rope-average", "--inputs", tmp_path / "tuned", "--num-update-checkpoints", "2",
             "--output", tmp_path / "avg.pt"])
    assert saved_options(tmp_path / "avg.pt")[ORIGIN]["arch"] == "transformer_tiny"
    run_cli(["fairseq-rope-export", "--checkpoint", tmp_path / "avg.pt", "--data-bin", data_bin,
             "--output-dir", tmp_path / "ct2"])
    info = json.loads((tmp_path / "ct2" / "export_info.json").read_text())
    assert info["init_from"]["sha256"] == saved_options(tmp_path / "avg.pt")[ORIGIN]["sha256"]
    (tmp_path / "in.en").write_text("w1 w2 w3\nw4 w5\n")
    run_cli(["fairseq-rope-translate", tmp_path / "in.en", "-o", tmp_path / "out.de", "--model-dir", tmp_path / "ct2",
             "--input-format", "bpe", "--output-format", "bpe", "--threads", "1"])
    assert len((tmp_path / "out.de").read_text().splitlines()) == 2


def test_a_start_that_does_not_map_one_to_one_is_refused_in_one_line_listing_each_difference(pretrained, tmp_path):
    data_bin, layout = pretrained
    refused = fine_tune(data_bin, layout / "model.pt", tmp_path / "a", "--encoder-layers", "3",
                        "--decoder-attention-heads", "4", "--encoder-normalize-before", check=False)
    line = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and line.startswith("fairseq-train: error: --finetune-from-model "), line
    for difference in ("--encoder-layers 2 in it, 3 here", "--decoder-attention-heads 2 in it, 4 here",
                       "--encoder-normalize-before False in it, True here"):
        assert difference in line, line
    assert not (tmp_path / "a" / "checkpoint_last.pt").exists()

    reordered = tmp_path / "reordered"
    shutil.copytree(layout, reordered)
    lines = (reordered / "dict.de.txt").read_text().splitlines(keepends=True)
    (reordered / "dict.de.txt").write_text("".join([lines[1], lines[0], *lines[2:]]))
    refused = fine_tune(data_bin, reordered / "model.pt", tmp_path / "b", check=False)
    line = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and "the target dictionary has its" in line and "another order (first at index" \
        in line, line


def test_a_relative_position_model_is_refused_and_learned_positions_are_dropped_by_name(tiny_data_bin, tmp_path):
    data_bin = tiny_data_bin / "data-bin"
    run_cli(["fairseq-train", data_bin, "--user-dir", "fairseq_rope", "--arch", "transformer_rpe_tiny",
             "--save-dir", tmp_path / "rpe", "--max-update", "1", *COMMON])
    refused = fine_tune(data_bin, tmp_path / "rpe" / "checkpoint_last.pt", tmp_path / "a", check=False)
    assert refused.returncode == 2 and "it is a relative-position model (transformer_rpe_tiny)" in \
        refused.stderr.strip().splitlines()[-1]

    run_cli(["fairseq-train", data_bin, "--arch", "transformer_tiny", "--encoder-learned-pos", "--decoder-learned-pos",
             "--save-dir", tmp_path / "learned", "--max-update", "1", *COMMON])
    log = fine_tune(data_bin, tmp_path / "learned" / "checkpoint_last.pt", tmp_path / "b")
    dropped = [line for line in (log.stdout + log.stderr).splitlines() if "starting weights: dropped" in line]
    assert len(dropped) == 1 and "encoder.embed_positions.weight, decoder.embed_positions.weight (learned " \
        "positions: no counterpart" in dropped[0], dropped


def test_the_sinusoidal_buffer_of_fairseqs_published_models_is_dropped(caplog):
    """fairseq's published models (and its versions before 0.12.3) save the sinusoidal positions'
    buffer, which a RoPE model has no place for."""
    state = {"encoder.embed_positions._float_tensor": torch.zeros(1), "decoder.embed_positions._float_tensor":
             torch.zeros(1), "encoder.embed_tokens.weight": torch.zeros(3, 2)}
    with caplog.at_level("INFO", logger="fairseq_rope.initialization"):
        drop_token_positions(state, "", ("encoder", "decoder"))
    assert list(state) == ["encoder.embed_tokens.weight"]
    assert [r.getMessage() for r in caplog.records] == [
        "starting weights: dropped encoder.embed_positions._float_tensor, decoder.embed_positions._float_tensor "
        "(the sinusoidal positions' buffer: no counterpart in this model, whose positions rotate)"]

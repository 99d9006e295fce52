"""scripts/quickstart.sh end to end with a very reduced configuration (tiny corpus, 300 updates;
the run of support/quickstart.py, whose model and corpus other modules use too): every step
runs, BLEU is printed with the sacreBLEU signature, and the loss plot is a PNG. The work
directory's name holds a space and shell metacharacters, so prepare, train, average and evaluate
(both engines) are shown to take paths as data, never as commands."""

import json
import re
from pathlib import Path

import pytest
from support.commands import REPO
from support.quickstart import QUICKSTART, shared_quickstart


@pytest.mark.e2e
def test_quickstart_runs_the_whole_pipeline(tmp_path_factory):
    run = shared_quickstart(tmp_path_factory)
    out = run.stdout
    for step in range(1, 7):
        assert f"{step}/6" in out
    assert f"update {QUICKSTART['MAX_UPDATE']}/{QUICKSTART['MAX_UPDATE']}  valid loss" in out
    m = re.search(r"Tokenized BLEU \(compound split\): ([0-9.]+)", out)
    assert m, out
    m = re.search(r"sacreBLEU: ([0-9.]+)  signature: (\S+)", out)
    assert m and m.group(2).startswith("nrefs:1|") and "tok:13a" in m.group(2), out
    engines = re.search(r"^  fairseq .*\n  ctranslate2 +([0-9.]+) +([0-9.]+) +([0-9.]+)$", out, re.M)
    assert engines, out  # both engines decoded the test set
    assert "SRC " in out and "HYP " in out  # an example
    png = Path(re.search(r"Loss plot:\s+(.+)$", out, re.M).group(1))
    assert png.is_relative_to(run.root)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    save_dir = png.parent
    assert (save_dir / "checkpoint.avg5.pt").exists()
    scores = json.loads((save_dir / "eval_avg5_test" / "scores.json").read_text())
    assert scores["sacrebleu"]["score"] == float(m.group(1))
    assert len((save_dir / "eval_avg5_test" / "hyp.detok.de").read_text().splitlines()) == 30

    # a second run finds every step complete and only reprints the results
    again = run.again
    assert "1/6 corpus:" in again and "exists, skipping" in again
    assert "3/6 training:" in again and "skipping" in again
    assert f"update {QUICKSTART['MAX_UPDATE']}/" not in again
    assert f"sacreBLEU: {m.group(1)}" in again
    # no step ran the name's $(touch x): no file x appeared where a shell would have created it
    assert not (REPO / "x").exists() and not list(run.root.parent.parent.rglob("x"))


def test_plot_losses_parses_fairseq_logs_and_writes_png(tmp_path, capsys):
    from fairseq_rope_tools.research import loss_plots, plot_losses

    log = tmp_path / "train.log"
    log.write_text(
        "2026-01-01 | INFO | train_inner | epoch 001:     10 / 163 loss=10.142, nll_loss=10.113, ppl=1107.59, "
        "wps=7314.1, ups=1.99, wpb=3715.8, bsz=260, num_updates=10, lr=0.0003, gnorm=1.84, train_wall=5, wall=8\n"
        "2026-01-01 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 9.01 | nll_loss 8.888 | ppl 473.82 "
        "| wps 49441.3 | wpb 2333.5 | bsz 124 | num_updates 20\n"
        "2026-01-01 | INFO | train | epoch 001 | loss 9.5 | nll_loss 9.4 | num_updates 20\n"
        # a resumed run logs update 10 again: the later value wins
        "2026-01-01 | INFO | train_inner | epoch 001:     10 / 163 loss=9.75, nll_loss=9.7, num_updates=10, lr=1\n"
        "2026-01-01 | INFO | valid | epoch 002 | valid on 'test' subset | loss 1.0 | num_updates 20\n",
        encoding="utf-8",
    )
    train, valid = loss_plots.parse_log(log)
    assert train == {10: 9.75} and valid == {20: 9.01}
    assert loss_plots.parse_log(log, subset="test")[1] == {20: 1.0}
    png = tmp_path / "out.png"
    plot_losses.main([str(log), str(log), "--label", "a", "--label", "b", "--output", str(png)])
    assert png.read_bytes()[:4] == b"\x89PNG"
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    with pytest.raises(SystemExit):
        plot_losses.main([str(empty), "--output", str(tmp_path / "x.png")])
    # the plot never goes over a log it reads
    with pytest.raises(SystemExit) as stop:
        plot_losses.main([str(log), "--output", str(log)])
    assert stop.value.code == 2 and "would overwrite its own input" in capsys.readouterr().err
    assert log.read_bytes()[:4] != b"\x89PNG"

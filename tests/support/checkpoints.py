"""Checkpoints for the tests: stand-ins shaped like fairseq's, the tiny training that writes real
ones, and fairseq-rope-average's one-line refusals."""

import argparse
import collections
import hashlib
import json
import os

import pytest
import torch

from fairseq_rope_tools.checkpoints import average_checkpoints as avg
from support.commands import run_cli
from support.shared import shared_directory


def make_checkpoint(path, params, arch="transformer_rope_tiny"):
    """A checkpoint shaped like fairseq's: model params, cfg with an argparse.Namespace, optimizer."""
    state = {
        "model": collections.OrderedDict(params),
        "cfg": {"model": argparse.Namespace(arch=arch, encoder_embed_dim=4), "common": {"seed": 1}},
        "args": None,
        "optimizer_history": [{"criterion_name": "LabelSmoothedCrossEntropyCriterion", "num_updates": 10}],
        "last_optimizer_state": {"state": {0: {"exp_avg": torch.ones(3)}}},
        "extra_state": {"train_iterator": {"epoch": 1}},
    }
    torch.save(state, path)
    return path


def random_params(seed, shapes=(("encoder.w", (4, 3)), ("decoder.b", (3,)))):
    g = torch.Generator().manual_seed(seed)
    params = {name: torch.randn(*shape, generator=g) for name, shape in shapes}
    params["encoder.version"] = torch.tensor([3])
    return params


def stopped(argv, capsys, status=1):
    """The one-line error with which ``fairseq-rope-average argv`` stops (its exit status checked),
    without its ``PROG: error:`` prefix."""
    with pytest.raises(SystemExit) as e:
        avg.main(argv)
    assert e.value.code == status
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the "averaging N checkpoints" lines
    assert ": error: " in last, last
    return last.split(": error: ", 1)[1]


def train_args(data_bin, save_dir, max_update):
    return [
        data_bin, "--user-dir", "fairseq_rope", "--arch", "transformer_rope_tiny", "--task", "translation",
        "--cpu", "--optimizer", "adam", "--lr", "3e-3", "--max-tokens", "1500", "--seed", "1",
        "--criterion", "label_smoothed_cross_entropy", "--max-update", max_update,
        "--save-interval-updates", "20", "--save-interval", "1000", "--no-epoch-checkpoints", "--save-dir", save_dir,
        "--num-workers", "0", "--log-format", "simple", "--log-interval", "10",
    ]


def train_tiny(data_bin, save_dir, *flags, max_update=150):
    """A tiny model trained on the reversal corpus until it has learned it (``flags``: the
    architecture and its options); returns its last checkpoint."""
    run_cli(["fairseq-train", data_bin, "--user-dir", "fairseq_rope", *flags, "--task", "translation", "--cpu",
             "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "5e-3", "--lr-scheduler",
             "inverse_sqrt", "--warmup-updates", "20", "--max-tokens", "1500", "--max-update", max_update,
             "--seed", "1", "--criterion", "cross_entropy", "--disable-validation", "--no-epoch-checkpoints",
             "--save-dir", save_dir, "--num-workers", "0", "--log-format", "simple", "--log-interval", "50"])
    return save_dir / "checkpoint_last.pt"


def shared_tiny_model(tmp_path_factory, data_bin, *flags):
    """:func:`train_tiny`'s checkpoint for ``flags``, trained once in a test run by the first pytest
    worker that asks (the others wait for it, then read it): the export tests of two modules train
    the same models on the same corpus, whose data-bin every worker builds alike (its files are in
    the key). Read it only: every worker shares it."""
    key = hashlib.sha256(json.dumps([str(flag) for flag in flags]).encode())
    for name in sorted(os.listdir(data_bin)):
        if name.endswith((".txt", ".bin", ".idx")):  # not fairseq-preprocess's log, which names the worker's paths
            key.update(name.encode() + (data_bin / name).read_bytes())
    return shared_directory(tmp_path_factory, "tiny_models", key.hexdigest(),
                            lambda directory: train_tiny(data_bin, directory, *flags)) / "checkpoint_last.pt"


def updates_in(path) -> int:
    return torch.load(path)["optimizer_history"][-1]["num_updates"]

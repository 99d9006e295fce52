"""Importing the plugin applies every patch of fairseq_rope.patches, once; with a fairseq it was
not written for, fairseq is left untouched and one warning names what is lost. (~6 s: one
subprocess)"""

import subprocess
import sys

import pytest
from support.commands import REPO

import fairseq_rope  # noqa: F401  (installs the patches)
from fairseq_rope import patches
from fairseq_rope.patches import MARK, PATCHES, install_patches

FAIRSEQ_PATCHES = [patch for patch in PATCHES if patch.fairseq]


def test_the_table_holds_every_patch():
    assert len(PATCHES) == 10 and len({patch.name for patch in PATCHES}) == 10
    assert all(patch.why for patch in PATCHES)


@pytest.mark.parametrize("patch", [p for p in PATCHES if p.attribute], ids=lambda p: p.name)
def test_with_this_fairseq_every_patch_is_applied(patch):
    assert getattr(getattr(patch.owner(), patch.attribute), MARK, False)


def test_fairseq_checkpoint_types_are_allow_listed():
    import torch

    from fairseq_rope.checkpoint_safe_globals import FAIRSEQ_CHECKPOINT_GLOBALS

    assert set(FAIRSEQ_CHECKPOINT_GLOBALS) <= set(torch.serialization.get_safe_globals())


def test_a_second_install_changes_nothing(monkeypatch):
    before = [getattr(p.owner(), p.attribute) for p in PATCHES if p.attribute]
    assert install_patches() == []
    monkeypatch.setattr(patches, "_installed", False)  # even run again, nothing is wrapped twice
    install_patches()
    assert [getattr(p.owner(), p.attribute) for p in PATCHES if p.attribute] == before


UNKNOWN_FAIRSEQ = """
import sys, fairseq
fairseq.__version__ = "0.13.0"
from fairseq import checkpoint_utils, trainer
from fairseq.data import data_utils
targets = [(checkpoint_utils, a) for a in ("torch_persistent_save", "PathManager", "verify_checkpoint_directory",
                                           "load_checkpoint", "load_checkpoint_to_cpu")]
targets += [(trainer.Trainer, "state_dict"), (trainer.Trainer, "load_checkpoint"), (data_utils, "batch_by_size")]
before = [getattr(owner, name) for owner, name in targets]
import fairseq_rope
from fairseq_rope.patches import install_patches
assert install_patches() == []  # the second call: nothing, and no second warning
assert [getattr(owner, name) for owner, name in targets] == before, "fairseq was patched"
assert sys.excepthook is not sys.__excepthook__, "the excepthook patch was not applied"
"""


def test_another_fairseq_is_left_unpatched_and_one_warning_names_what_is_lost():
    proc = subprocess.run([sys.executable, "-c", UNKNOWN_FAIRSEQ], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "fairseq_rope is written for fairseq" in line]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "not 0.13.0: fairseq is left unpatched" in warnings[0]
    for patch in FAIRSEQ_PATCHES:
        assert f"{patch.name}: {patch.why}" in warnings[0]
    assert "sys.excepthook" not in warnings[0] and "torch.serialization" not in warnings[0]


def test_the_plugin_and_tools_load_weights_only_where_torch_can():
    """torch 2.4 and 2.5 have the allow-list but load with weights_only=False by default: the
    plugin's and the tools' own loads ask for weights_only=True there; before 2.4 they cannot."""
    from types import SimpleNamespace

    from fairseq_rope.checkpoint_safe_globals import safe_load_kwargs

    assert safe_load_kwargs(SimpleNamespace(add_safe_globals=lambda types: None)) == {"weights_only": True}
    assert safe_load_kwargs(SimpleNamespace()) == {}

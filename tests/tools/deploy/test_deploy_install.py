"""The deploy part installed alone: a fresh virtual environment with this package (a wheel of the
checkout) and its dependencies only -- no torch, no fairseq, which the package does not require --
translates raw text from a bundle of fairseq-rope-export, CTranslate2's or ONNX, as the full
environment does.

Offline: the dependencies' distributions, and those they require, are taken from this
environment's site-packages (their files linked into the new one, with their metadata, so that
the new environment's pip sees them installed and resolves the wheel's requirements to them)
rather than downloaded."""

import importlib.metadata
import os
import shutil
import subprocess
import sys

import pytest
import tomllib
from support.commands import REPO, run_cli
from support.corpora import subword_work_dir

pytest.importorskip("ctranslate2")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")  # for the export, in this environment
packaging_requirements = pytest.importorskip("packaging.requirements")

pytestmark = pytest.mark.e2e  # trains a model and builds a virtual environment
DEPENDENCIES = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
TRAINING_ONLY = {"torch", "fairseq", "fairseq-fixed", "hydra-core", "omegaconf", "torchaudio", "triton"}


def requirement_closure(requirements):
    """The names of the distributions ``requirements`` name, and those they require, as installed here."""
    pending = [packaging_requirements.Requirement(line) for line in requirements]
    names = {}
    while pending:
        requirement = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = requirement.name.lower().replace("_", "-")
        if name in names:
            continue
        names[name] = distribution = importlib.metadata.distribution(name)
        assert distribution.version in requirement.specifier, (name, distribution.version, requirement)
        pending += [packaging_requirements.Requirement(r) for r in distribution.requires or []]
    return names


def link_distribution(distribution, site_packages):
    """The files of an installed distribution, linked into another environment's site-packages."""
    for file in distribution.files or []:
        source = distribution.locate_file(file)
        if ".." in file.parts or not source.is_file():  # its console scripts live in bin/: not needed
            continue
        target = site_packages / file
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.symlink_to(source)


@pytest.fixture(scope="module")
def deploy_env(tmp_path_factory):
    """A fresh virtual environment with the deploy install: its python."""
    root = tmp_path_factory.mktemp("deploy_env")
    closure = requirement_closure(DEPENDENCIES)
    assert not TRAINING_ONLY & closure.keys(), closure.keys()
    # a wheel of the checkout, built from a copy (a build writes build/ and *.egg-info beside its sources)
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("fairseq_rope_base", "fairseq_rope", "fairseq_rope_tools", "examples"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    # relative paths: pip reads a ';' in a path (the tests' directory has one) as the start of a marker
    run_cli([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
             "--wheel-dir", "../wheels", "."], cwd=source, timeout=300)
    venv = root / "venv"
    run_cli([sys.executable, "-m", "venv", venv], timeout=300)
    python = venv / "bin" / "python"
    site_packages = next((venv / "lib").glob("python3*/site-packages"))
    for distribution in closure.values():
        link_distribution(distribution, site_packages)
    wheels = [wheel.name for wheel in (root / "wheels").glob("*.whl")]
    # with its dependencies, from nothing but what is linked in: pip finds each one installed
    run_cli([python, "-m", "pip", "install", "--no-index", "-q", *wheels], cwd=root / "wheels", timeout=300)
    return python


@pytest.fixture(scope="module")
def bundle(tiny_data_bin, tmp_path_factory):
    """{format: export} of a tiny RoPE model after one update, exported to each format with the
    segmentation of a work dir as prepare.sh leaves it (subword-nmt codes that keep the corpus'
    words whole)."""
    root = tmp_path_factory.mktemp("deploy_bundle")
    work = subword_work_dir(root, tiny_data_bin)
    run_cli(["fairseq-train", work / "data-bin", "--user-dir", "fairseq_rope", "--arch", "transformer_rope_tiny",
             "--task", "translation", "--cpu", "--optimizer", "adam", "--lr", "5e-3", "--max-tokens", "1500",
             "--max-update", "1", "--criterion", "cross_entropy", "--disable-validation", "--no-epoch-checkpoints",
             "--save-dir", root / "checkpoints", "--num-workers", "0"])
    exports = {}
    for model_format in ("ctranslate2", "onnx"):
        exports[model_format] = root / model_format
        proc = run_cli(["fairseq-rope-export", "--format", model_format, "--checkpoint",
                        root / "checkpoints" / "checkpoint_last.pt", "--data-bin", work / "data-bin", "--output-dir",
                        exports[model_format]])
        assert "a bundle with its segmentation (subword_nmt)" in proc.stderr
    return exports


def test_the_deploy_install_translates_from_a_bundle_without_torch(deploy_env, bundle, tiny_data_bin, tmp_path):
    python = deploy_env
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{python.parent}{os.pathsep}/usr/bin:/bin")
    for module in ("torch", "fairseq"):
        proc = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, (module, proc.stderr[-2000:])
    proc = subprocess.run([python, "-c", "import fairseq_rope"], capture_output=True, env=env, cwd=tmp_path)
    assert proc.returncode != 0  # the plugin is installed with the tools, and cannot load without torch
    raw = tmp_path / "input.en"
    raw.write_text("".join((tiny_data_bin / "test.en").read_text().splitlines(keepends=True)[:10]))
    # the console script run by the environment's python: for a path with spaces pip writes it as a
    # sh/python polyglot, whose sh part would expand the tests' directory's $(...)
    for model_format, model_dir in bundle.items():  # the engine each bundle declares
        deployed = subprocess.run([python, python.parent / "fairseq-rope-translate", "--model-dir", model_dir, raw,
                                   "-o", tmp_path / f"deployed.{model_format}.de", "--threads", "1"],
                                  capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
        assert deployed.returncode == 0, deployed.stderr[-4000:]
        assert "10 lines (10 to translate)" in deployed.stderr and f"({model_format}, beam 4" in deployed.stderr
        run_cli(["fairseq-rope-translate", "--model-dir", model_dir, raw, "-o", tmp_path / f"full.{model_format}.de",
                 "--threads", "1"])
        deployed_lines = (tmp_path / f"deployed.{model_format}.de").read_text()
        assert deployed_lines == (tmp_path / f"full.{model_format}.de").read_text()
        assert len(deployed_lines.splitlines()) == 10
    # the fairseq engine needs what a deployment does not install: one line, not a traceback
    fake_checkpoint = tmp_path / "checkpoint.pt"
    fake_checkpoint.write_bytes(b"")
    refused = subprocess.run([python, python.parent / "fairseq-rope-translate", "--engine", "fairseq", "--checkpoint",
                              fake_checkpoint, "--data-bin", tiny_data_bin, raw], capture_output=True, text=True,
                             env=env, cwd=tmp_path, timeout=300)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "fairseq-rope-translate: error: --engine fairseq needs torch and fairseq, which this environment lacks: "
        "install them (docs/usage.md#install), or translate an export with --model-dir"], refused.stderr[-2000:]

"""Installing the package: into this environment and into another one that already has torch and
fairseq, regular and editable, without installing or replacing any of the training stack; the
version floors the plugin checks when imported, and `--user-dir "$(fairseq-rope-user-dir)"` from
any directory (docs/usage.md#install)."""

import ast
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import types
from pathlib import Path

import pytest
import tomllib
from support.commands import REPO, run_cli

from fairseq_rope import checkpoint_safe_globals, requirements
from fairseq_rope_tools import cli, user_dir

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
# what a training environment keeps as it is: installing the package never installs, upgrades or
# replaces one of them
TRAINING_STACK = {"torch", "torchaudio", "fairseq", "fairseq-fixed", "hydra-core", "omegaconf"}


def requirement_name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)).lower()


# ------------------------------------------------------------------ what the package asks for


def test_no_requirement_of_the_package_or_its_extras_is_in_the_training_stack():
    project = PYPROJECT["project"]
    requested = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requested += extra
    assert {requirement_name(r) for r in requested} & TRAINING_STACK == set()


def test_every_package_of_the_source_is_installed():
    """A regular install holds only the listed packages: one left out works in the checkout and
    in an editable install, and is missing from every other."""
    on_disk = {".".join(init.parent.relative_to(REPO).parts)
               for top in ("fairseq_rope_base", "fairseq_rope", "fairseq_rope_tools")
               for init in (REPO / top).rglob("__init__.py")}
    assert on_disk - set(PYPROJECT["tool"]["setuptools"]["packages"]) == set()
    assert {path.stem for path in REPO.glob("*.py")} == set()  # no top-level module: packages only
    assert "py-modules" not in PYPROJECT["tool"]["setuptools"]


def test_every_file_parses_as_the_oldest_supported_python():
    floor = tuple(int(part) for part in requirements.PYTHON_FLOOR.split("."))
    assert PYPROJECT["project"]["requires-python"] == f">={requirements.PYTHON_FLOOR}"
    for path in sorted([*REPO.glob("*.py"), *(REPO / "fairseq_rope").rglob("*.py"),
                        *(REPO / "fairseq_rope_tools").rglob("*.py")]):
        ast.parse(path.read_text(encoding="utf-8"), filename=str(path), feature_version=floor)


def test_the_floors_and_tested_versions_are_stated_alike_everywhere():
    from fairseq_rope.patches import FAIRSEQ_VERSIONS

    assert requirements.FAIRSEQ_FLOOR == min(FAIRSEQ_VERSIONS, key=requirements.release)
    usage = (REPO / "docs" / "usage.md").read_text(encoding="utf-8")
    table = {row[0]: row[1:] for row in (
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in usage.split("### Versions", 1)[1].split("\n\n")[2].splitlines()[2:])}
    setup = (REPO / "scripts" / "setup_env.sh").read_text(encoding="utf-8")

    def installed_by_setup(variable):
        return re.search(rf'{variable}="\$\{{{variable}:-[\w-]+==([\w.]+)\}}"', setup).group(1)

    assert table["Python"][0] == f">= {requirements.PYTHON_FLOOR}"
    assert table["torch"][:2] == [f">= {requirements.TORCH_FLOOR}", f"{installed_by_setup('TORCH_SPEC')} (CPU wheel)"]
    assert table["fairseq"][0].startswith(f">= {requirements.FAIRSEQ_FLOOR}: {', '.join(FAIRSEQ_VERSIONS[:-1])}")
    assert table["fairseq"][1] == f"fairseq-fixed {installed_by_setup('FAIRSEQ_SPEC')}"
    assert table["Triton (optional: the fused rotation on CUDA)"][1].startswith(installed_by_setup("TRITON_FALLBACK_SPEC"))
    assert "hydra-core==1.3.2 omegaconf==2.3.0" in setup and table["hydra-core, omegaconf"][1] == "1.3.2, 2.3.0"
    stated = re.search(r"^#   (Python .*)$", (REPO / "pyproject.toml").read_text(encoding="utf-8"), re.M).group(1)
    assert stated.startswith(f"Python >= {requirements.PYTHON_FLOOR}, torch >= {requirements.TORCH_FLOOR}, "
                             f"fairseq >= {requirements.FAIRSEQ_FLOOR}")


# ------------------------------------------------------------------ the check at import


def fake_import(**versions):
    """An import_module whose modules have the given __version__ (None: not installed)."""

    def import_module(name):
        if versions.get(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return types.SimpleNamespace(__version__=versions[name])

    return import_module


@pytest.mark.parametrize("python, torch, fairseq, refused", [
    ("3.11.4", "2.13.0+cpu", "0.12.3.1", None),
    ("3.9.0", "2.1.0", "0.12.2", None),
    ("3.10.12", "2.5.0a0+e000cf0ad9.nv24.10", "0.12.3", None),  # an NVIDIA container's torch
    ("3.11.4", "2.13.0", "0.13.0", None),  # newer: runs, and the patches warn (test_patches.py)
    ("3.8.18", "2.1.0", "0.12.2", "fairseq_rope needs Python >= 3.9, found Python 3.8.18 for "),
    ("3.11.4", None, None, "fairseq_rope needs torch >= 2.1, which is not installed for "),
    ("3.11.4", "2.0.1+cu118", "0.12.2", "fairseq_rope needs torch >= 2.1, found torch 2.0.1+cu118 for "),
    ("3.11.4", "2.13.0", None, "fairseq_rope needs fairseq >= 0.12.2 (on Python 3.11: the fork "
                               "fairseq-fixed 0.12.3.1), which is not installed for "),
    ("3.11.4", "2.13.0", "0.10.2", "fairseq_rope needs fairseq >= 0.12.2 (on Python 3.11: the fork "
                                   "fairseq-fixed 0.12.3.1), found fairseq 0.10.2 for "),
])
def test_a_missing_or_old_requirement_is_named_with_the_version_found_and_the_range(python, torch, fairseq, refused):
    problem = requirements.requirements_problem(fake_import(torch=torch, fairseq=fairseq), python_version=python)
    if refused is None:
        assert problem is None
    else:
        assert problem.startswith(refused) and problem.endswith("(docs/usage.md#install)") and "\n" not in problem


def test_a_broken_dependency_of_an_installed_fairseq_is_not_called_a_missing_fairseq():
    def import_module(name):
        raise ModuleNotFoundError("No module named 'hydra'", name="hydra")

    with pytest.raises(ModuleNotFoundError, match="hydra"):
        requirements.requirements_problem(import_module)


def test_the_allow_list_is_used_only_where_torch_has_one():
    checkpoint_safe_globals.allow_fairseq_checkpoint_types(types.SimpleNamespace())  # torch < 2.4: nothing to do
    allowed = []
    checkpoint_safe_globals.allow_fairseq_checkpoint_types(types.SimpleNamespace(add_safe_globals=allowed.extend))
    assert allowed == checkpoint_safe_globals.FAIRSEQ_CHECKPOINT_GLOBALS


# ------------------------------------------------------------------ fairseq-rope-user-dir


def test_the_user_dir_command_prints_the_plugins_directory(capsys):
    import fairseq_rope

    user_dir.main([])
    assert capsys.readouterr().out == str(Path(fairseq_rope.__file__).parent) + "\n"


def test_the_user_dir_command_loads_neither_torch_nor_the_plugin():
    """It runs inside `$(...)` before every fairseq command: it finds the plugin without importing it."""
    code = ("import sys\nfrom fairseq_rope_tools import user_dir\nuser_dir.main([])\n"
            "print(sorted(m for m in ('torch', 'fairseq', 'fairseq_rope') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.splitlines()[1] == "[]", proc.stderr[-2000:]


def test_the_user_dir_command_without_the_plugin_says_so_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(sys, "argv", ["fairseq-rope-user-dir"])
    with pytest.raises(SystemExit) as stopped:
        user_dir.main([])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (f"fairseq-rope-user-dir: error: this Python ({sys.executable}) has no "
                                       "fairseq_rope: install the package into its environment (docs/usage.md#install)\n")


# ------------------------------------------------------------------ end to end: pip and fairseq

TINY_TRAINING = [
    "--arch", "transformer_rope_tiny", "--task", "translation", "--cpu", "--optimizer", "adam", "--lr", "1e-3",
    "--max-tokens", "1500", "--no-epoch-checkpoints", "--num-workers", "0", "--log-format", "simple", "--seed", "1",
]


def copy_of_the_source(directory: Path) -> Path:
    """What a checkout holds for pip: the package's files, copied so that the build's egg-info and
    build/ land there and not in the checkout."""
    source = directory / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("fairseq_rope_base", "fairseq_rope", "fairseq_rope_tools", "examples"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return source


def pip_installs(python, *args, cwd) -> list:
    """The distributions ``python -m pip install ARGS`` installs (or would, with --dry-run), offline:
    no index, and this environment's setuptools for the build."""
    proc = run_cli([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
                    "--no-build-isolation", "--report", "-", *args], cwd=cwd)
    return sorted(item["metadata"]["name"] for item in json.loads(proc.stdout)["install"])


@pytest.mark.e2e
def test_installing_into_this_environment_installs_only_the_package(tmp_path):
    """`make setup` installed everything the package and its extras ask for."""
    extras = "plots,dev,onnx" + (",gpu" if sys.platform.startswith("linux") else "")
    installs = pip_installs(sys.executable, "--dry-run", f".[{extras}]", cwd=copy_of_the_source(tmp_path))
    assert installs == ["fairseq-rope"]


@pytest.fixture(scope="module")
def training_stack_view(tmp_path_factory):
    """A directory that shows this environment's site-packages without the package: torch,
    fairseq and the rest, as a user's training environment has them."""
    view = tmp_path_factory.mktemp("training-stack")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not (entry.name.startswith(("fairseq_rope", "__editable__")) or entry.suffix == ".pth"):
            (view / entry.name).symlink_to(entry)
    return view


def second_environment(directory: Path, view: Path) -> Path:
    """A virtual environment whose .pth file adds ``view``: it has torch and fairseq, not the
    package. Its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True)
    site_packages = next(directory.glob("lib/python3*/site-packages"))
    (site_packages / "training-stack.pth").write_text(f"{view}\n", encoding="utf-8")
    return directory / "bin" / "python"


@pytest.fixture
def environment_directory():
    """Where the second environment goes: not under the tests' worst-named directory, since pip
    writes a console script's interpreter path into a double-quoted sh line when it holds a space,
    where a shell runs ``$(...)``: no console script of pip's works there (fairseq-train's neither)."""
    with tempfile.TemporaryDirectory(prefix="fairseq-rope-env-") as directory:
        yield Path(directory)


@pytest.mark.e2e
@pytest.mark.parametrize("editable", [False, True], ids=["regular", "editable"])
def test_an_existing_environment_gets_only_the_package_and_trains_from_any_directory(
        tiny_data_bin, training_stack_view, environment_directory, tmp_path, editable):
    python = second_environment(environment_directory, training_stack_view)
    source = copy_of_the_source(tmp_path)
    documented = ["-e", "."] if editable else ["."]  # docs/usage.md: `pip install .`, `pip install -e .`
    assert pip_installs(python, "--dry-run", *documented, cwd=source) == ["fairseq-rope"]
    assert pip_installs(python, *documented, cwd=source) == ["fairseq-rope"]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": f"{python.parent}:/usr/bin:/bin", "PYTHONPATH": "", "PYTHON": str(python),
           "DATA": str(tiny_data_bin / "data-bin")}
    # the documented form, through a shell; fairseq's commands by module: its console scripts are
    # the first environment's
    said = run_cli(["bash", "-c", 'fairseq-rope-user-dir; "$PYTHON" -m fairseq_cli.train "$DATA" '
                    '--user-dir "$(fairseq-rope-user-dir)" --save-dir checkpoints --max-update 3 "$@"', "bash",
                    *TINY_TRAINING], cwd=elsewhere, env=env)
    plugin = Path(said.stdout.splitlines()[0])
    site_packages = next(environment_directory.glob("lib/python3*/site-packages"))
    assert plugin == (source if editable else site_packages) / "fairseq_rope"
    assert "TransformerRopeModel" in said.stdout + said.stderr
    generated = run_cli(["bash", "-c", '"$PYTHON" -m fairseq_cli.generate "$DATA" --user-dir "$(fairseq-rope-user-dir)" '
                         '--path checkpoints/checkpoint_last.pt --cpu --beam 2 --batch-size 16 --gen-subset test'],
                        cwd=elsewhere, env=env)
    assert sum(line.startswith("H-") for line in generated.stdout.splitlines()) == 43


TRAIN_IN_PROCESS = ("import sys, torch.serialization\n"
                    "{prelude}\n"
                    "sys.argv[0] = 'fairseq-train'\n"
                    "from fairseq_cli.train import cli_main\n"
                    "cli_main()\n")


@pytest.mark.e2e
def test_the_plugin_imports_trains_and_resumes_on_a_torch_without_add_safe_globals(tiny_data_bin, tmp_path):
    """torch before 2.4 has no allow-list, and loads with weights_only=False by default (as
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 makes torch 2.13 do)."""
    # first torch's own modules that call it when imported (torch >= 2.4 does; older ones do not)
    script = TRAIN_IN_PROCESS.format(prelude="import torch._dynamo, torch.distributed.tensor, torch.nested\n"
                                             "del torch.serialization.add_safe_globals")
    args = [sys.executable, "-c", script, tiny_data_bin / "data-bin", "--user-dir", cli.plugin_dir(),
            "--save-dir", tmp_path, *TINY_TRAINING]
    trained = run_cli([*args, "--max-update", "2"], cwd=tmp_path)
    assert "TransformerRopeModel" in trained.stdout + trained.stderr
    resumed = run_cli([*args, "--max-update", "3"], cwd=tmp_path, env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch \d+ @ 2 updates\)", resumed.stdout + resumed.stderr)


@pytest.mark.e2e
@pytest.mark.parametrize("prelude, refusal", [
    ("import fairseq; fairseq.__version__ = '0.10.2'",
     "fairseq-train: error: fairseq_rope needs fairseq >= 0.12.2 (on Python 3.11: the fork fairseq-fixed "
     "0.12.3.1), found fairseq 0.10.2 for "),
    ("import torch; torch.__version__ = '2.0.1'",
     "fairseq-train: error: fairseq_rope needs torch >= 2.1, found torch 2.0.1 for "),
])
def test_fairseq_train_with_an_old_requirement_stops_at_import_in_one_line(tiny_data_bin, tmp_path, prelude, refusal):
    proc = run_cli([sys.executable, "-c", TRAIN_IN_PROCESS.format(prelude=prelude), tiny_data_bin / "data-bin",
                    "--user-dir", cli.plugin_dir(), "--save-dir", tmp_path / "never", *TINY_TRAINING,
                    "--max-update", "1"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].startswith(refusal), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "never").exists()

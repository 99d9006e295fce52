"""The tools' package: every fairseq-rope-* command is installed and starts, nothing is imported
by its file path, and the tools that must not load torch or fairseq do not."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from support.commands import BIN, REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
COMMANDS = PYPROJECT["project"]["scripts"]

# the harness's modules, each importing only those before it
HARNESS_LAYERS = ("variants", "progress", "data", "report", "decoding", "runs", "schedule", "command")
# Translating with CTranslate2, serving, the recipe's text steps and the harness run where torch is
# not wanted (a deploy machine, a data-preparation job). The rule, by folder: every module of
# fairseq_rope_base and fairseq_rope_tools imports without torch, fairseq, the plugin or
# CTranslate2 (they load them inside the functions that need them), except these, which work on
# torch checkpoints or tensors at their core. A new module falls under the rule by being there.
# The CTranslate2 path of fairseq-rope-translate also runs end to end without them
# (tests/tools/deploy/test_translate_reliability.py).
NEEDS_TORCH = {
    "fairseq_rope_tools.checkpoints.average_checkpoints": "averages torch checkpoints",
    "fairseq_rope_tools.deploy.checkpoint_export": "reads the checkpoint it exports",
    "fairseq_rope_tools.deploy.ctranslate2_spec": "builds the spec from the model's tensors",
    "fairseq_rope_tools.deploy.ctranslate2_scaling": "scales the model's frequencies with the plugin's",
    "fairseq_rope_tools.deploy.export_ctranslate2": "the export command, over the two above",
    "fairseq_rope_tools.deploy.onnx_graphs": "traces the model's modules into ONNX graphs",
    "fairseq_rope_tools.research.benchmarks.ablate_rotation_cost": "times the rotation in torch",
    "fairseq_rope_tools.research.benchmarks.speed": "times torch models",
    "fairseq_rope_tools.research.benchmarks.speed_measures": "times torch models",
    "fairseq_rope_tools.research.plot_rope_decay": "computes the plugin's rotary decay",
}
TORCH_FREE_PACKAGES = ("fairseq_rope_base", "fairseq_rope_tools")


def _package_modules(*packages):
    for package in packages:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


TORCH_FREE = [module for module in _package_modules(*TORCH_FREE_PACKAGES) if module not in NEEDS_TORCH]


def _python_files(*folders):
    for folder in folders:
        yield from sorted((REPO / folder).rglob("*.py"))


@pytest.mark.e2e
def test_every_command_is_installed_and_prints_its_help():
    assert len(COMMANDS) >= 14
    for command in COMMANDS:
        proc = subprocess.run([str(BIN / command), "--help"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (command, proc.stderr[-2000:])


def test_every_command_prints_its_version(capsys, monkeypatch):
    """In-process, each console script's main as pyproject.toml names it, started under its name."""
    import importlib

    version = PYPROJECT["project"]["version"]
    for command, entry in COMMANDS.items():
        module, _, function = entry.partition(":")
        monkeypatch.setattr(sys, "argv", [command])
        with pytest.raises(SystemExit) as stopped:
            getattr(importlib.import_module(module), function)(["--version"])
        assert (stopped.value.code in (0, None), capsys.readouterr().out) == (True, f"{command} {version}\n"), command


def test_tools_that_must_not_load_torch_do_not():
    """Each module of the rule in a fresh interpreter, two at a time; every offender listed at once."""
    from concurrent.futures import ThreadPoolExecutor

    assert set(NEEDS_TORCH) <= set(_package_modules(*TORCH_FREE_PACKAGES)), "NEEDS_TORCH names a module that is gone"
    assert "fairseq_rope_tools.deploy.serve" in TORCH_FREE and len(TORCH_FREE) > 60

    def loaded_by(module):
        code = (f"import sys, {module}\n"
                "print(sorted(m for m in ('torch', 'fairseq', 'fairseq_rope', 'ctranslate2') if m in sys.modules))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
        return proc.stdout.strip() if proc.returncode == 0 else f"failed: {proc.stderr.strip()[-300:]}"

    with ThreadPoolExecutor(max_workers=2) as pool:
        found = dict(zip(TORCH_FREE, pool.map(loaded_by, TORCH_FREE)))
    assert {module: loaded for module, loaded in found.items() if loaded != "[]"} == {}


def _imported_modules(path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def test_layers_import_only_downwards():
    """fairseq_rope_base imports neither package, and the plugin nothing of the tools (lazy
    imports inside functions included): a layer never imports the one above it."""
    above = {str(path.relative_to(REPO)): ("fairseq_rope", "fairseq_rope_tools")
             for path in _python_files("fairseq_rope_base")}
    above.update({str(path.relative_to(REPO)): ("fairseq_rope_tools",) for path in _python_files("fairseq_rope")})
    offenders = [(name, module) for name, packages in above.items() for module in _imported_modules(REPO / name)
                 if module.split(".")[0] in packages]
    assert offenders == []


def _module_imports(path, package_root):
    """The modules of the project ``path`` imports, anywhere in it (lazy imports included), its
    relative imports resolved."""
    module = ".".join(path.relative_to(package_root).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def test_no_import_circle():
    """No module imports, however lazily, a module that imports it back (through any chain)."""
    files = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
             for p in _python_files("fairseq_rope", "fairseq_rope_tools")}
    graph = {name: {m for m in _module_imports(path, REPO) if m in files and m != name} for name, path in files.items()}
    circles, state = [], {}

    def visit(name, chain):
        state[name] = "open"
        for imported in sorted(graph[name]):
            if state.get(imported) == "open":
                circles.append(chain[chain.index(imported):] + [imported])
            elif imported not in state:
                visit(imported, chain + [imported])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == [], "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_nothing_is_imported_by_its_path():
    """No sys.path edits and no module loaded from a file name, anywhere in the project."""
    offenders = []
    for path in _python_files("fairseq_rope", "fairseq_rope_tools", "tests", "scripts", "examples"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("spec_from_file_location", "run_path"):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.attr}")
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} sys.path")
    assert offenders == []


def test_scripts_and_examples_hold_no_python():
    """scripts/ and examples/ hold shell steps that run the installed commands; code that another
    file imports lives in a package."""
    assert list(_python_files("scripts", "examples")) == []


@pytest.mark.e2e
def test_the_installed_recipe_is_the_checkouts(tmp_path):
    """The tools run the recipe installed with them (make setup copies it from examples/)."""
    code = ("from fairseq_rope_tools.recipes import recipe_step\n"
            "print(recipe_step('wmt14_en_de', 'train.sh').parent)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    installed = Path(proc.stdout.strip())
    assert installed != REPO / "examples" / "wmt14_en_de", "the recipe is not installed: run make setup"
    for step in (REPO / "examples" / "wmt14_en_de").glob("*.sh"):
        assert (installed / step.name).read_bytes() == step.read_bytes(), f"{step.name} changed: run make setup"


def test_each_harness_module_imports_only_the_layers_below_it():
    package = REPO / "fairseq_rope_tools" / "research" / "compare"
    assert sorted(p.stem for p in package.glob("*.py") if p.stem != "__init__") == sorted(HARNESS_LAYERS)
    for position, name in enumerate(HARNESS_LAYERS):
        tree = ast.parse((package / f"{name}.py").read_text())
        imported = {node.module.rpartition(".")[2] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and (node.module or "").startswith("fairseq_rope_tools.research.compare.")}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                     and node.module == "fairseq_rope_tools.research.compare" for alias in node.names}
        above = imported - set(HARNESS_LAYERS[:position])
        assert not above, f"research/compare/{name}.py imports {sorted(above)}, which are not below it"


def test_no_module_imports_a_command():
    """A command module holds its parser and main; what two commands need is a library both import."""
    commands = {entry.partition(":")[0] for entry in COMMANDS.values()}
    found = set()
    for path in _python_files("fairseq_rope_tools"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            found |= {(module, name) for name in names if name in commands and name != module}
    assert found == set(), "a module imports a command: move what it needs into a library"


def test_every_command_parses_with_the_one_parser_class():
    """cli.ArgumentParser (--version, and what to do with a value that starts with '-') is every
    command's parser: no module builds a plain argparse parser."""
    plain = set()
    for path in _python_files("fairseq_rope_tools"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "ArgumentParser"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "argparse"):
                plain.add(str(path.relative_to(REPO)))
    assert plain == set(), f"plain argparse parsers: use fairseq_rope_tools.cli.ArgumentParser in {sorted(plain)}"


def test_top_level_names_are_unique_across_the_packages():
    """A function or class name means one thing in the whole project (a reader who meets
    ``verified_bundle`` twice should not have to check which); every command has its ``main``
    and ``parse_args``."""
    defined = {}
    for path in _python_files("fairseq_rope_base", "fairseq_rope", "fairseq_rope_tools"):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.setdefault(node.name, []).append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in defined.items()
            if len(paths) > 1 and name not in ("main", "parse_args")} == {}

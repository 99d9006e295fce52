"""The shell recipes that tools run (the comparison harness, gpu_check): installed with the
package from ``examples/``, where they are edited and documented."""

from pathlib import Path


def recipe_step(recipe: str, script: str) -> Path:
    """``examples/RECIPE/SCRIPT`` as installed beside this package, or in the checkout this
    package is imported from (``python -m pytest`` in the checkout, before ``make setup``)."""
    installed = Path(__file__).resolve().parent / recipe / script
    if installed.is_file():
        return installed
    return Path(__file__).resolve().parents[2] / "examples" / recipe / script

"""pyproject's ranges, the lower bounds `make test-oldest` installs and the pins `make install` uses agree."""
from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as _canonical
from packaging.version import Version

from tests.pins import read_pins

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

REPO = Path(__file__).resolve().parents[2]


def _requirements(*, oldest: bool = False) -> dict[str, Requirement]:
    """Every direct requirement; `oldest`: those `make test-oldest` installs ('.[dev]': not the trl, wandb and mlflow
    extras, see pyproject)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = {k: v for k, v in project["optional-dependencies"].items()
              if not (oldest and k in ("trl", "wandb", "mlflow"))}
    reqs = [*project["dependencies"], *(r for extra in extras.values() for r in extra)]
    return {_canonical(r.name): r for r in map(Requirement, reqs)}



def test_lowest_pins_are_pyproject_lower_bounds():
    lowest = read_pins(REPO / "requirements" / "lowest.txt")
    for name, req in _requirements(oldest=True).items():
        lower = [s.version for s in req.specifier if s.operator == ">="]
        assert lower, f"{name} has no lower bound in pyproject.toml"
        if name == "torch":  # installed from the local file before anything else, by every Makefile target
            continue
        assert lowest.get(name) == lower[0], f"{name}: lowest.txt {lowest.get(name)} vs pyproject >={lower[0]}"
    assert set(lowest) <= set(_requirements(oldest=True)), "lowest.txt pins only direct dependencies"


def test_pins_satisfy_pyproject_ranges():
    pins = read_pins(REPO / "requirements" / "constraints.txt")
    for name, req in _requirements().items():
        assert name in pins, f"{name} is not pinned in requirements/constraints.txt: run `make upgrade-deps`"
        assert Version(pins[name]) in req.specifier, f"{name}=={pins[name]} is outside pyproject's {req}"

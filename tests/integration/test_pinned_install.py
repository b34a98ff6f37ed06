"""The venv the suite runs in holds the pinned versions (requirements/constraints.txt), as `make install` puts
them there: a fresh clone next month tests what CI tested, not whatever was released that morning.

Packages installed beyond the pins are ignored (a developer's extra tools); a pinned transitive dependency may be
absent (another platform resolves another set), a pinned direct dependency may not.
"""
from __future__ import annotations

import re
from importlib import metadata

from packaging.utils import canonicalize_name as _canonical

from tests.pins import REQUIREMENTS, read_pins

PINS = REQUIREMENTS / "constraints.txt"


def _direct_dependencies() -> set[str]:
    """shardtune's own requirements (extras included), read from its installed metadata."""
    return {_canonical(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in metadata.requires("shardtune") or []}


def test_venv_has_the_pinned_versions():
    pins = read_pins(PINS)
    assert len(pins) > 20, "constraints.txt looks truncated"
    direct = _direct_dependencies()
    wrong, missing = [], []
    for name, pinned in pins.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            if name in direct:
                missing.append(name)
            continue
        if installed.split("+")[0] != pinned:  # torch's local label (+cpu) is not part of the pin
            wrong.append(f"{name} {installed} (pinned {pinned})")
    assert not missing and not wrong, (
        f"installed versions differ from {PINS.name}: {wrong}, missing {missing}; "
        "reinstall with `make clean install` (or move the pins with `make upgrade-deps`)")

"""Reading requirements/*.txt pin files, shared by the pin tests (unit: ranges agree; integration: the venv)."""
from __future__ import annotations

from pathlib import Path

from packaging.utils import canonicalize_name

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements"


def read_pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of a file of `name==version` lines (comments and blank lines skipped)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins

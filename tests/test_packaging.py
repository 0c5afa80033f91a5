"""A non-editable install of the wheel: every module of moe_plugin/ is in it, the ``moe-plugin`` command works,
and the package imports from where it was installed, not from the checkout.

The wheel is built from a copy of the checkout's package and top-level build files in a temporary directory:
building in the checkout would write ``build/`` there, and setuptools' ``build/lib`` keeps files deleted since
an earlier build, which would mask a module left out. The fresh venv gets its dependencies from this one's
site-packages through a ``.pth`` line (nothing is downloaded, torch is not reinstalled); the wheel goes in
with ``--no-deps``. The commands run from a temporary directory, so the checkout is not on ``sys.path``.
"""

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

import moe_plugin

pytestmark = pytest.mark.distributed  # every test here starts processes

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "moe_plugin"
TIMEOUT_S = 900  # building, a venv and imports of torch/transformers on a loaded 2-core machine


def _run(cmd, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"{cmd} exited with {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel path, the fresh venv's python, its bin directory, a working directory outside the repo)."""
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "source"
    shutil.copytree(PACKAGE, source / "moe_plugin", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in REPO.iterdir():  # setup.cfg, pyproject.toml, README.md (the long description), ...
        if path.is_file() and not path.name.startswith("."):
            shutil.copy2(path, source / path.name)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            tmp / "dist",
            source,
        ],
        cwd=tmp,
    )
    (wheel,) = (tmp / "dist").glob("moe_plugin-*.whl")

    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).stdout.strip()
    )
    # a plain path line: this venv's .pth files (the editable install's finder among them) are not run
    (site / "moe_plugin_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel], cwd=tmp)
    work = tmp / "work"
    work.mkdir()
    return wheel, python, env_dir / "bin", work, site


def test_the_wheel_holds_every_module_and_no_data(installed):
    wheel = installed[0]
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    shipped = {n for n in names if n.startswith("moe_plugin/") and n.endswith(".py")}
    in_repo = {p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert "moe_plugin/training/__init__.py" in shipped
    assert in_repo - shipped == set(), f"left out of the wheel: {sorted(in_repo - shipped)}"
    assert not any(n.startswith(("recipes/", "ds_configs/", "moe_plugin/recipes")) for n in names), (
        "recipes and DeepSpeed configs are user data, read from paths given at run time"
    )


def test_the_command_lists_subcommands_and_prints_the_version(installed):
    _, python, bin_dir, work, _ = installed
    help_text = _run([bin_dir / "moe-plugin", "--help"], cwd=work).stdout
    assert "train" in help_text and "<subcommand>" in help_text, help_text
    version = _run([bin_dir / "moe-plugin", "--version"], cwd=work).stdout.strip()
    metadata = _run([python, "-c", "import importlib.metadata as m; print(m.version('moe_plugin'))"], cwd=work)
    assert version == f"moe-plugin {metadata.stdout.strip()}"
    assert installed[0].name.startswith(f"moe_plugin-{metadata.stdout.strip()}-"), "one version everywhere"
    assert metadata.stdout.strip() == moe_plugin.__version__, "the checkout's own version"


def test_modules_import_from_the_installed_location(installed):
    _, python, _, work, site = installed
    out = (
        _run([python, "-c", "import moe_plugin.train, moe_plugin.recipe.schema as r; print(r.__file__)"], cwd=work)
        .stdout.strip()
        .splitlines()[-1]
    )
    assert Path(out).resolve() == (site / "moe_plugin" / "recipe" / "schema.py").resolve(), out
    assert REPO not in Path(out).resolve().parents

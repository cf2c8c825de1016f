"""scripts/install.sh's decisions, offline: its --dry-run prints them and the commands it would run.

Each case copies the scripts into a temporary repository and runs them with a stand-in
``python3`` (and ``nvidia-smi``) first on PATH: the stand-in answers install.sh's probes
(``# probe: NAME``) from environment variables and hands everything else to this Python.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")

FAKE_PYTHON = r"""#!/usr/bin/env bash
# A stand-in interpreter: install.sh's probes get the answers of FAKE_* variables.
if [ "${1:-}" = -c ]; then
  case "$2" in
    "# probe: externally-managed"*) echo "${FAKE_EXTERNALLY_MANAGED:-0}"; exit 0 ;;
    "# probe: torch"*) exit "${FAKE_NO_TORCH:-0}" ;;
    "# probe: cutlass-dsl"*) exit "${FAKE_NO_DSL:-0}" ;;
  esac
fi
if [ "${1:-}" = -m ] && [ "${2:-}" = pip ] && [ "${3:-}" = config ]; then
  printf '%s\n' "${FAKE_PIP_CONFIG:-}"
  exit 0
fi
exec REAL_PYTHON "$@"
"""

FAKE_SMI = r"""#!/usr/bin/env bash
# A stand-in nvidia-smi: no driver unless FAKE_CUDA_VERSION is set.
[ -n "${FAKE_CUDA_VERSION:-}" ] || { echo "NVIDIA-SMI has failed" >&2; exit 9; }
if [ "${1:-}" = -L ]; then echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"; exit 0; fi
echo "| NVIDIA-SMI 580.00    Driver Version: 580.00    CUDA Version: ${FAKE_CUDA_VERSION}     |"
"""


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture
def repo(tmp_path):
    """A repository with the two scripts and a bin folder of stand-ins."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("install.sh", "python"):
        shutil.copy2(ROOT / "scripts" / name, root / "scripts" / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "python3", FAKE_PYTHON.replace("REAL_PYTHON", sys.executable))
    _executable(bin_dir / "nvidia-smi", FAKE_SMI)
    return root


def run(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith(("PIP_", "KERNEL_API_", "TORCH_", "FAKE_"))
                   and k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHON")}
    environment["PATH"] = f"{repo.parent / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"
    environment["PIP_CONFIG_FILE"] = os.devnull
    environment.update(env)
    return subprocess.run([BASH, str(repo / "scripts" / "install.sh"), *args], cwd=repo.parent, env=environment,
                          capture_output=True, text=True, timeout=60)


def plan(repo: Path, *args: str, **env: str) -> dict[str, str]:
    """The decisions of a dry run: {"python": ..., "torch": ..., "cuda extra": ..., "venv": ...,
    "commands": "\n"-joined would-run lines}."""
    done = run(repo, "--dry-run", *args, **env)
    assert done.returncode == 0, done.stderr
    decisions = {"commands": "\n".join(line for line in done.stdout.splitlines() if line.startswith("would run:"))}
    for line in done.stdout.splitlines():
        if line.startswith("install.sh: "):
            key, _, value = line[len("install.sh: "):].partition(": ")
            decisions[key] = value
    return decisions


def test_the_scripts_parse():
    for name in ("install.sh", "python"):
        done = subprocess.run([BASH, "-n", str(ROOT / "scripts" / name)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_an_externally_managed_python_gets_a_venv(repo):
    p = plan(repo, FAKE_EXTERNALLY_MANAGED="1")
    assert p["python"].startswith(".venv/bin/python (python3 is externally managed")
    assert "creating ./.venv" in p["venv"]
    assert "would run: python3 -m venv .venv" in p["commands"]
    # The new venv has no torch: on a machine without a GPU it comes from PyTorch's CPU index.
    assert "from PyTorch's CPU index" in p["torch"]
    assert ("would run: .venv/bin/python -m pip install -q torch==2.13.0 --index-url "
            "https://download.pytorch.org/whl/cpu") in p["commands"]
    assert p["cuda extra"].startswith("cu13 (no NVIDIA GPU")
    assert p["commands"].endswith(r"would run: .venv/bin/python -m pip install -q --no-build-isolation -e .\[cu13\,dev\]")


@pytest.mark.parametrize("env", [{"VIRTUAL_ENV": "/somewhere/venv"}, {"CONDA_PREFIX": "/opt/conda"},
                                 {"PIP_BREAK_SYSTEM_PACKAGES": "1"}])
def test_an_active_environment_or_an_override_is_used_as_it_is(repo, env):
    p = plan(repo, FAKE_EXTERNALLY_MANAGED="1", **env)
    assert p["python"].startswith("python3 (")
    assert "venv" not in p and "-m venv" not in p["commands"]


def test_a_plain_python_is_installed_into_directly(repo):
    """What CI does (a fresh clone, pyenv's python3): no venv; torch and the DSL already there."""
    p = plan(repo)
    assert p["python"] == "python3 (python3 on PATH)" and "venv" not in p
    assert p["torch"] == "keeping the installed torch"
    assert p["cuda extra"].startswith("none (nvidia-cutlass-dsl is installed")
    assert p["commands"].splitlines() == [
        r"would run: python3 -m pip install -q setuptools\>=70.1 apache-tvm-ffi\>=0.1.15\,\<0.2",
        r"would run: python3 -m pip install -q --no-build-isolation -e .\[dev\]"]


def test_an_existing_venv_is_used_and_can_be_forced(repo):
    p = plan(repo, KERNEL_API_VENV="1")
    assert p["python"] == ".venv/bin/python (KERNEL_API_VENV=1)" and "-m venv .venv" in p["commands"]
    venv_python = repo / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    _executable(venv_python, FAKE_PYTHON.replace("REAL_PYTHON", sys.executable))
    p = plan(repo, FAKE_EXTERNALLY_MANAGED="1")
    assert p["python"] == ".venv/bin/python (./.venv exists)" and "-m venv" not in p["commands"]


def test_a_local_torch_wheel_is_preferred(repo, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    for env in ({"PIP_FIND_LINKS": str(wheels)}, {"FAKE_PIP_CONFIG": f"global.find-links='{wheels}'"}):
        p = plan(repo, FAKE_NO_TORCH="1", **env)
        assert p["torch"].startswith("installing torch==2.13.0 from the local wheel")
        assert "would run: python3 -m pip install -q torch==2.13.0\n" in p["commands"] + "\n"


@pytest.mark.parametrize("cuda, extra", [("12.4", "cu12"), ("13.0", "cu13")])
def test_a_gpu_machine_gets_pypi_torch_and_the_drivers_cuda_extra(repo, cuda, extra):
    p = plan(repo, FAKE_NO_TORCH="1", FAKE_NO_DSL="1", FAKE_CUDA_VERSION=cuda)
    assert p["torch"].startswith("installing torch==2.13.0 from PyPI")
    assert "--index-url" not in p["commands"]
    assert p["cuda extra"] == f"{extra} (the driver supports CUDA {cuda.split('.')[0]})"
    assert rf"-e .\[{extra}\,dev\]" in p["commands"]


def test_explicit_choices(repo):
    p = plan(repo, FAKE_NO_TORCH="1", KERNEL_API_CUDA="cu12", TORCH_INDEX_URL="https://example.invalid/whl")
    assert "torch==2.13.0 --index-url https://example.invalid/whl" in p["commands"]
    assert p["cuda extra"] == "cu12 (KERNEL_API_CUDA)" and r"-e .\[cu12\,dev\]" in p["commands"]
    bad = run(repo, "--dry-run", KERNEL_API_CUDA="cu11")
    assert bad.returncode == 2 and "KERNEL_API_CUDA must be" in bad.stderr
    assert run(repo, "--bogus").returncode == 2


def test_scripts_python_runs_the_interpreter_install_sh_chose(repo, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHON")}
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = "import os, sys; print(os.getcwd())"
    done = subprocess.run([str(repo / "scripts" / "python"), "-c", code], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == str(elsewhere), done.stderr  # python3, cwd kept
    venv_python = repo / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    _executable(venv_python, "#!/usr/bin/env bash\necho \"venv python $*\"\n")
    done = subprocess.run([str(repo / "scripts" / "python"), "-m", "pytest"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "venv python -m pytest", done.stderr
    assert run(repo, "--which-python").stdout.strip() == ".venv/bin/python"


def test_the_externally_managed_probe(tmp_path, monkeypatch, capsys):
    """The probe's own logic, with the marker file of PEP 668 present or not, in a venv or not."""
    import sysconfig

    script = (ROOT / "scripts" / "install.sh").read_text()
    start = script.index("# probe: externally-managed")
    code = script[start:script.index("'", start)]
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: str(tmp_path))
    monkeypatch.setattr(sys, "base_prefix", sys.prefix)

    def probe() -> str:
        exec(compile(code, "probe", "exec"), {})
        return capsys.readouterr().out.strip()

    assert probe() == "0"
    (tmp_path / "EXTERNALLY-MANAGED").write_text("[externally-managed]\n")
    assert probe() == "1"
    monkeypatch.setattr(sys, "base_prefix", sys.prefix + "-base")  # inside a venv, PEP 668 does not apply
    assert probe() == "0"


def test_lower_bounds_install_into_their_own_environment_with_the_constraints(repo):
    """--lower-bounds: never the active environment (it would be downgraded), always cu13 (the
    extra ci/lower-bounds.txt is written for), and -c that file on every pip install."""
    p = plan(repo, "--lower-bounds", VIRTUAL_ENV="/somewhere/venv")
    assert p["python"].startswith(".venv-lower-bounds/bin/python (--lower-bounds")
    assert "would run: python3 -m venv .venv-lower-bounds" in p["commands"]
    assert p["cuda extra"] == "cu13 (--lower-bounds)"
    installs = [c for c in p["commands"].splitlines() if "-m pip install -q" in c and "torch" not in c]
    assert installs == [
        r"would run: .venv-lower-bounds/bin/python -m pip install -q -c ci/lower-bounds.txt setuptools\>=70.1 "
        r"apache-tvm-ffi\>=0.1.15\,\<0.2",
        r"would run: .venv-lower-bounds/bin/python -m pip install -q -c ci/lower-bounds.txt --no-build-isolation "
        r"-e .\[cu13\,dev\]"]
    which = run(repo, "--which-python", "--lower-bounds")
    assert which.stdout.strip() == ".venv-lower-bounds/bin/python"
    bad = run(repo, "--dry-run", "--lower-bounds", KERNEL_API_CUDA="cu12")
    assert bad.returncode == 2 and "--lower-bounds installs the cu13 extra" in bad.stderr


"""The package's metadata (pyproject.toml): the cu12 / cu13 extras each select one CUDA major,
versions are ranges, every third-party module kernel_api imports is declared, and the build
requirements are the ones scripts/install.sh installs before building without isolation."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
requirements = pytest.importorskip("packaging.requirements")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DEPENDENCIES = PROJECT["project"]["dependencies"]
EXTRAS = PROJECT["project"]["optional-dependencies"]

# The distributions whose releases are built for one CUDA major (by version or by name).
CUDA_VERSIONED = ("cuda-bindings", "nvidia-cuda-nvrtc")
CUDA_NAMED = {"nvidia-cuda-nvrtc-cu12": 12, "nvidia-cutlass-dsl-libs-cu12": 12, "nvidia-cutlass-dsl-libs-cu13": 13}

# Imported module (its top two names, or one) -> the distribution that provides it.
PROVIDERS = {"torch": "torch", "cutlass": "nvidia-cutlass-dsl", "tvm_ffi": "apache-tvm-ffi",
             "cuda.bindings": "cuda-bindings", "cuda.core": "cuda-core", "cuda.pathfinder": "cuda-pathfinder",
             "numpy": "numpy", "platformdirs": "platformdirs", "tqdm": "tqdm", "matplotlib": "matplotlib",
             "cryptography": "cryptography", "triton": "triton", "transformers": "transformers"}
OPTIONAL = {"matplotlib": "plot", "cryptography": "sign", "triton": "triton",
            "transformers": "models"}  # imported only by a feature that names its extra when it is missing


def parse(specs: list[str]) -> list:
    return [requirements.Requirement(s) for s in specs]


def by_name(specs: list[str]) -> dict:
    return {r.name: r for r in parse(specs)}


def allows_major(req, major: int) -> bool:
    """Whether ``req`` allows some release of CUDA major ``major`` (x.0 ... x.99)."""
    return any(req.specifier.contains(f"{major}.{minor}", prereleases=False) for minor in range(100))


def test_no_exact_pins_anywhere():
    everything = DEPENDENCIES + [s for specs in EXTRAS.values() for s in specs] + PROJECT["build-system"]["requires"]
    pinned = [s for s in everything if re.search(r"===?", s)]
    assert not pinned, f"exact pins (use a range): {pinned}"


@pytest.mark.parametrize("name", ["nvidia-cutlass-dsl", "apache-tvm-ffi", "cuda-core", "cuda-pathfinder",
                                  "cuda-bindings"])
def test_the_toolchain_has_a_bounded_range(name):
    req = by_name(DEPENDENCIES)[name]
    operators = {s.operator for s in req.specifier}
    assert ">=" in operators and "<" in operators, f"{name}: {req.specifier} (want a lower and an upper bound)"


def test_the_documented_ranges():
    deps = by_name(DEPENDENCIES)
    assert str(deps["nvidia-cutlass-dsl"].specifier) in ("<5,>=4.8.1", ">=4.8.1,<5")
    assert deps["apache-tvm-ffi"].specifier.contains("0.1.15.post2")
    assert not deps["apache-tvm-ffi"].specifier.contains("0.2.0")


def test_the_default_install_is_cuda_neutral():
    """Without an extra nothing forces a CUDA major (cuda-python 13 did, through cuda-bindings)."""
    deps = by_name(DEPENDENCIES)
    assert "cuda-python" not in deps  # its releases pin cuda-bindings to their own major
    assert allows_major(deps["cuda-bindings"], 12) and allows_major(deps["cuda-bindings"], 13)
    for name, req in deps.items():
        assert name not in CUDA_NAMED and not name.startswith("nvidia-cuda-nvrtc"), name
        assert not req.extras, f"{name}[{','.join(req.extras)}] chooses a CUDA variant"


@pytest.mark.parametrize("extra, major", [("cu12", 12), ("cu13", 13)])
def test_each_cuda_extra_selects_one_major(extra, major):
    reqs = by_name(EXTRAS[extra])
    other = 13 if major == 12 else 12
    # The three pieces, together: the DSL's libraries, cuda-bindings and NVRTC.
    assert "nvidia-cutlass-dsl" in reqs and "cuda-bindings" in reqs
    nvrtc = [n for n in reqs if n.startswith("nvidia-cuda-nvrtc")]
    assert len(nvrtc) == 1, reqs
    for name, req in reqs.items():
        if name in CUDA_NAMED:
            assert CUDA_NAMED[name] == major, f"{extra} asks for {name}"
        if name in CUDA_VERSIONED:
            assert allows_major(req, major) and not allows_major(req, other), f"{extra}: {req}"
    nvrtc_req = reqs[nvrtc[0]]
    if nvrtc[0] in CUDA_NAMED:
        assert CUDA_NAMED[nvrtc[0]] == major
    else:
        assert allows_major(nvrtc_req, major) and not allows_major(nvrtc_req, other), nvrtc_req
    # nvidia-cutlass-dsl always brings its CUDA 12 libraries; its cu13 extra adds the CUDA 13 ones,
    # which the DSL loads on a driver that supports them.
    assert reqs["nvidia-cutlass-dsl"].extras == ({"cu13"} if major == 13 else set())


def test_the_extras_keep_the_base_ranges():
    """An extra narrows a base requirement; it never leaves the base range (the resolver would fail)."""
    base = by_name(DEPENDENCIES)
    for extra in ("cu12", "cu13"):
        for name, req in by_name(EXTRAS[extra]).items():
            if name in base:
                lower = [s.version for s in req.specifier if s.operator == ">="]
                assert lower and all(base[name].specifier.contains(v) for v in lower), f"{extra}: {req} vs {base[name]}"


def _third_party_imports() -> dict[str, list[str]]:
    """Imported module (top one or two names) -> files, for every import of kernel_api's own code
    that is neither the standard library nor kernel_api."""
    found: dict[str, list[str]] = {}
    package = ROOT / "kernel_api"
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("kernel_api", "__future__"):
                    continue
                key = ".".join(name.split(".")[:2]) if top == "cuda" else top
                found.setdefault(key, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_imported_distribution_is_declared():
    deps = by_name(DEPENDENCIES)
    missing = []
    for module, files in sorted(_third_party_imports().items()):
        dist = PROVIDERS.get(module)
        if dist is None:
            missing.append(f"{module} (imported by {files[0]}): add it to PROVIDERS and pyproject.toml")
        elif module in OPTIONAL:
            assert dist in by_name(EXTRAS[OPTIONAL[module]]), f"{dist} belongs in the {OPTIONAL[module]} extra"
        elif dist not in deps:
            missing.append(f"{dist} (imported as {module} by {files[0]})")
    assert not missing, "undeclared dependencies:\n" + "\n".join(missing)


def test_plot_is_an_extra_and_not_a_dependency():
    assert "matplotlib" in by_name(EXTRAS["plot"])
    assert "matplotlib" not in by_name(DEPENDENCIES)


def test_install_script_installs_the_build_requirements():
    """install.sh builds without isolation after installing the build requirements itself: they
    must be pyproject's, or the native module is built against another tvm_ffi."""
    script = (ROOT / "scripts" / "install.sh").read_text()
    line = re.search(r"^BUILD_REQUIREMENTS=\((.*)\)", script, re.M)
    assert line, "install.sh: BUILD_REQUIREMENTS=(...) not found"
    assert re.findall(r'"([^"]+)"', line.group(1)) == PROJECT["build-system"]["requires"]
    assert "--no-build-isolation" in script


LOWER_BOUNDS = ROOT / "ci" / "lower-bounds.txt"
LOWER_BOUNDS_CU12 = ROOT / "ci" / "lower-bounds-cu12.txt"
# Ranged requirements ci/lower-bounds.txt leaves free, and why.
NOT_PINNED = {
    "torch": "CI keeps the CPU torch it finds (a local wheel or PyTorch's CPU index); PyPI's old torch "
             "releases are CUDA builds that pull gigabytes of CUDA wheels",
    "setuptools": "a build requirement: the environment's torch needs a newer one (torch 2.13 wants >= 77.0.3)",
}


def _pins(path: Path = LOWER_BOUNDS) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = requirements.Requirement(line)
            specs = list(req.specifier)
            assert len(specs) == 1 and specs[0].operator == "==", f"ci/{path.name}: {line} (want name==version)"
            pins[req.name] = specs[0].version
    return pins


@pytest.mark.parametrize("path,declared", [
    (LOWER_BOUNDS, lambda: DEPENDENCIES + EXTRAS["cu13"] + EXTRAS["dev"] + EXTRAS["plot"]
     + PROJECT["build-system"]["requires"]),
    (LOWER_BOUNDS_CU12, lambda: DEPENDENCIES + EXTRAS["cu12"]),
], ids=["cu13-dev-install", "cu12-resolve"])
def test_every_ranged_dependency_is_pinned_to_its_lower_bound_for_ci(path, declared):
    """ci/lower-bounds.txt (what `install.sh --lower-bounds` and so .ci/run install with) pins,
    for CI's install (`.[cu13,dev]`, the build requirements), every requirement with a lower bound
    to the lowest release of its range: the bound itself or its first release (13.0 -> 13.0.48).
    ci/lower-bounds-cu12.txt does the same for `.[cu12]`'s runtime dependencies (CI resolves
    them with pip, without installing)."""
    version = pytest.importorskip("packaging.version")
    reqs = parse(declared())
    bounds: dict = {}
    for r in reqs:
        for spec in r.specifier:
            if spec.operator == ">=":
                bounds[r.name] = max(bounds.get(r.name, version.Version("0")), version.Version(spec.version))
    pins = _pins(path)
    missing = sorted(name for name in bounds if name not in pins and name not in NOT_PINNED)
    assert not missing, f"ranged dependencies without a pin in ci/{path.name}: {missing}"
    assert not set(pins) & set(NOT_PINNED), "pinned although listed as not pinned"
    assert not set(pins) - set(bounds), f"pins of no ranged dependency: {sorted(set(pins) - set(bounds))}"
    for name, pinned in pins.items():
        found = version.Version(pinned)
        for r in reqs:
            assert r.name != name or r.specifier.contains(found, prereleases=True), f"{name}=={pinned} is outside {r}"
        bound = bounds[name]
        assert found.release[:len(bound.release)] == bound.release, \
            f"{name}=={pinned} is not the lower bound {bound} (nor a release of it)"

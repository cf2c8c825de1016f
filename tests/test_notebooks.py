"""The walkthrough notebooks: well-formed with outputs cleared (CPU), and executed end to end
on a GPU (any cell error fails the test): with nbclient and a Jupyter kernel where they are
installed, else as one script of the code cells in a fresh Python process (`_run_as_script`)."""

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def test_the_eight_walkthroughs_exist():
    assert [n[:3] for n in NAMES] == ["000", "001", "002", "003", "004", "005", "006", "007"]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_clean_and_parses(name):
    nb = json.loads((NOTEBOOKS / name).read_text())
    assert nb["nbformat"] == 4
    cells = nb["cells"]
    assert cells[0]["cell_type"] == "markdown"
    for cell in cells:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, f"{name}: outputs not cleared"
            source = "".join(cell["source"])
            ast.parse(source, filename=f"{name}:{cell['id']}")


def _run_notebook(path: Path, timeout: int) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(path, as_version=4)
    env_path = os.pathsep.join(p for p in sys.path if p)
    os.environ["PYTHONPATH"] = env_path  # the kernel process finds kernel_api and the DSL as we do
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()


def test_cute_dsl_kernel_defined_in_a_cell_compiles(tmp_path):
    """The DSL reads kernel source; IPython keeps cell source in linecache, check it suffices."""
    pytest.importorskip("cutlass")
    nbformat = pytest.importorskip("nbformat")
    cell = '''
import cutlass, cutlass.cute as cute
@cute.kernel
def add_one(x: cute.Tensor):
    i, _, _ = cute.arch.thread_idx()
    x[i] = x[i] + cutlass.Float32(1)
@cute.jit
def launch(x: cute.Tensor):
    add_one(x).launch(grid=[1, 1, 1], block=[32, 1, 1])
from kernel_api.providers.cutedsl.kernel import fake_tensor
compiled = cute.compile(launch, fake_tensor(cutlass.Float32, 1, 0, 1), options="--gpu-arch sm_90a")
assert compiled is not None
'''
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    path = tmp_path / "probe.ipynb"
    nbformat.write(nb, path)
    _run_notebook(path, timeout=300)


def notebook_script(path: Path) -> str:
    """The code cells of notebook ``path``, in order, as one script (the walkthroughs use no
    magics or shell escapes: `test_notebooks_need_no_jupyter_kernel_to_run` keeps it so)."""
    cells = json.loads(path.read_text())["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code") + "\n"


def _run_as_script(path: Path, tmp_path: Path, timeout: int) -> None:
    """Run the notebook's code cells as a script file in a fresh process, from the notebook's
    folder (as a Jupyter kernel would): a file, so that the CuTe DSL can read the source of
    kernels defined in cells. Its output is shown when it fails."""
    script = tmp_path / (path.stem + ".py")
    script.write_text(notebook_script(path))
    # The notebook's folder first: a Jupyter kernel imports modules beside the notebook (001's
    # f64_gemm_impl), while a script's own folder (here tmp_path) is what Python puts first.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(path.parent)] + [p for p in sys.path if p])}
    done = subprocess.run([sys.executable, str(script)], cwd=path.parent, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{path.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"


def _has_jupyter() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("nbformat", "nbclient", "ipykernel"))


def test_notebooks_need_no_jupyter_kernel_to_run():
    """Every code line is plain Python (no %magics, !shell, get_ipython): the script fallback
    runs exactly what a Jupyter kernel would."""
    for name in NAMES:
        for line in notebook_script(NOTEBOOKS / name).splitlines():
            assert not line.lstrip().startswith(("%", "!")) and "get_ipython" not in line, f"{name}: {line}"


def test_the_script_fallback_runs_cells_in_order_and_fails_on_an_error(tmp_path):
    def notebook(*sources):
        cells = [{"cell_type": "markdown", "source": ["# t"]}] + [
            {"cell_type": "code", "source": [src], "outputs": [], "execution_count": None} for src in sources]
        path = tmp_path / "nb" / "t.ipynb"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": cells}))
        return path

    # cells share one namespace, run from the notebook's folder, import modules beside the
    # notebook, and see this process's sys.path
    (tmp_path / "nb").mkdir(exist_ok=True)
    (tmp_path / "nb" / "beside_the_notebook.py").write_text("VALUE = 1\n")
    _run_as_script(notebook("import os, inspect\ndef f(): return 41",
                            "assert f() + 1 == 42 and os.path.basename(os.getcwd()) == 'nb'\n"
                            "assert 'return 41' in inspect.getsource(f)\nimport kernel_api",
                            "from beside_the_notebook import VALUE\nassert VALUE == 1"), tmp_path, timeout=120)
    with pytest.raises(AssertionError, match="ZeroDivisionError"):
        _run_as_script(notebook("x = 1", "1 / 0"), tmp_path, timeout=120)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes(name, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if _has_jupyter():
        _run_notebook(NOTEBOOKS / name, timeout=600)
    else:  # (the GPU machine's carried packages hold no Jupyter kernel)
        _run_as_script(NOTEBOOKS / name, tmp_path, timeout=600)

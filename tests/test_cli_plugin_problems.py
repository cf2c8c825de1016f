"""An operation a package adds (examples/vector_add) reaches the command line through the
``kernel_api.problems`` entry point group, without a change to kernel_api; a faulty entry point
is skipped with a warning naming it."""

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest

from kernel_api.cli import problems
from kernel_api.cli.commands import main
from kernel_api.cli.precompile import entry_arguments, load_shapes
from kernel_api.providers.cutedsl import CuTeDSLProvider

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: An entry point's object that describes an operation kernel_api describes already.
AGAIN = problems.PROBLEMS["gemm"]


def __getattr__(name):
    # An entry point whose loading calls sys.exit (this module's "exits_on_load").
    if name == "exits_on_load":
        sys.exit(3)
    raise AttributeError(name)


@pytest.fixture
def installed(monkeypatch):
    """examples/ importable and the given entry points installed in the group, for one test."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import vector_add

    if vector_add.CuteVectorAdd not in CuTeDSLProvider.kernel_classes():
        CuTeDSLProvider.register(vector_add.CuteVectorAdd)

    def install(*pairs):
        points = [importlib.metadata.EntryPoint(name, value, problems.ENTRY_POINT_GROUP) for name, value in pairs]
        monkeypatch.setattr(problems.importlib.metadata, "entry_points",
                            lambda group=None: points if group == problems.ENTRY_POINT_GROUP else [])
        monkeypatch.setattr(problems, "_all", None)

    yield install
    problems._all = None
    CuTeDSLProvider.unregister(vector_add.CuteVectorAdd)
    sys.modules.pop("vector_add.problem", None)


def test_a_packages_operation_is_listed_explained_and_read_from_a_shapes_file(installed, tmp_path, capsys):
    installed(("vector_add", "vector_add.problem:PROBLEM"))
    assert main(["list", "vector_add", "--n", "4096", "--dtype", "bf16", "--cc", "90"]) == 0
    out = capsys.readouterr().out
    assert "CuteVectorAdd_bf16_v8" in out and "CuteVectorAdd_bf16_v1" in out
    assert main(["explain", "vector_add", "--n", "7", "--cc", "90", "--provider", "cutedsl"]) == 0
    assert "not a multiple of 8" in capsys.readouterr().out
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps([{"op": "vector_add", "n": 1000}, {"op": "softmax", "rows": 2, "cols": 8}]))
    entries = load_shapes(path)
    assert entries[0] == {"op": "vector_add", "n": 1000, "dtype": "f16"}
    assert type(entry_arguments(entries[0], 0)).__name__ == "VectorAddArguments"
    assert main(["list", "vector_add", "--n", "0"]) == 2
    assert "--n must be an integer >= 1, got 0" in capsys.readouterr().err


def test_a_faulty_entry_point_is_skipped_with_a_warning_and_the_rest_stay(installed, capsys):
    installed(("broken", "vector_add.no_such_module:PROBLEM"), ("vector_add", "vector_add.problem:PROBLEM"),
              ("not_one", "kernel_api.cli.problems:PROBLEMS.values"), ("again", "test_cli_plugin_problems:AGAIN"),
              ("exits", "test_cli_plugin_problems:exits_on_load"))
    with pytest.warns(RuntimeWarning) as caught:
        found = problems.all_problems()
    messages = [str(w.message) for w in caught]
    assert any("broken (vector_add.no_such_module:PROBLEM) skipped: ModuleNotFoundError" in m for m in messages)
    assert any("not_one" in m and "TypeError" in m for m in messages), messages
    assert any("again" in m and "operation 'gemm' is described already" in m for m in messages), messages
    assert any("exits" in m and "SystemExit: 3" in m for m in messages), messages
    assert "vector_add" in found and set(problems.PROBLEMS) <= set(found)
    assert main(["list", "softmax", "--rows", "2", "--cols", "8", "--cc", "90"]) == 0

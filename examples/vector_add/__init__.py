"""An example operation for kernel_api: ``out = x + y`` on 1-D tensors, end to end.

Not part of kernel_api (nothing under ``kernel_api/`` imports it, and it is not installed with
the package); docs/adding-an-operation.md walks through it. Put ``examples/`` on ``sys.path``
and ``import vector_add``: that registers `CuteVectorAdd` with the CuTe DSL provider, after
which `kernel_api.get_kernels(VectorAddArguments(x, y, out))` finds its instances.

- ``arguments``: `VectorAddArguments`, the operation's arguments type;
- ``metadata``: `VectorAddOperandsMetadata` and `VectorAddDesign`, what an instance accepts;
- ``cute_add``: the kernel family's interface file (`CuteVectorAdd`), registered on import;
- ``operation``: the operation's description (`VECTOR_ADD`), from which importing it generates
  ``torch.ops.kernel_api_examples.vector_add`` and `add`, the function to call;
- ``implementations/add_impl.py``: its CuTe DSL code, imported only when a kernel compiles;
- ``problem``: its description for the ``kernel-api`` command line (`PROBLEM`), which a package
  declares in the ``kernel_api.problems`` entry point group (not imported here).
"""

from .arguments import VectorAddArguments
from .metadata import VectorAddDesign, VectorAddOperandsMetadata
from .cute_add import CuteVectorAdd
from .operation import VECTOR_ADD, add

__all__ = ["VECTOR_ADD", "CuteVectorAdd", "VectorAddArguments", "VectorAddDesign", "VectorAddOperandsMetadata", "add"]

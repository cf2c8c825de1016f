"""What a kernel instance is and what it accepts, as plain data.

Discovery compares these descriptions with the `TensorAttributes` that an arguments object
records for its operands; nothing here touches a GPU or imports a DSL. ``operands`` describes
the tensors a kernel takes, ``design`` its knobs, ``epilogue`` its fused epilogue, ``kernel``
the `KernelMetadata` that holds them. `TensorAttributes` and the stride patterns live in
`kernel_api.core.tensor_attributes` (arguments use them too) and are re-exported here.
"""

from ..arguments.epilogue import ACTIVATIONS
from ..core.tensor_attributes import COLUMN_MAJOR, ROW_MAJOR, TensorAttributes, pad_pattern
from .design import BLASDesignMetadata, RowReductionDesignMetadata
from .epilogue import EpilogueMetadata
from .kernel import KernelMetadata
from .operands import (GemmOperandsMetadata, OperandsMetadata, SoftmaxBackwardOperandsMetadata, SoftmaxOperandsMetadata,
                       softmax_operands)

__all__ = ["ACTIVATIONS", "BLASDesignMetadata", "COLUMN_MAJOR", "EpilogueMetadata", "GemmOperandsMetadata",
           "KernelMetadata", "OperandsMetadata", "ROW_MAJOR", "RowReductionDesignMetadata",
           "SoftmaxBackwardOperandsMetadata", "SoftmaxOperandsMetadata", "TensorAttributes", "pad_pattern",
           "softmax_operands"]

"""What a kernel instance is and what it accepts, as plain data."""

from .operands import (ACTIVATIONS, COLUMN_MAJOR, ROW_MAJOR, BLASDesignMetadata, EpilogueMetadata, GemmOperandsMetadata,
                       KernelMetadata, OperandsMetadata, RowReductionDesignMetadata, SoftmaxBackwardOperandsMetadata,
                       SoftmaxOperandsMetadata, TensorAttributes, pad_pattern, softmax_operands)

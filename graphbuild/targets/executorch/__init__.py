"""The ExecuTorch target: a ``.pte`` program for ExecuTorch's runtime, XNNPACK-delegated
(``xnnpack``), on portable kernels (``portable``) or through Arm's VGF flow (``vgf``).

It shares the torch.export front end (and the ``capture`` cache entries) with the QNN target.
Importing this package declares the target only; ``executorch`` is imported by its stages and
is an optional extra: ``pip install 'graphbuild[executorch]'``.
"""

from __future__ import annotations

from graphbuild.targets.base import Target, lazy_builder
from graphbuild.targets.executorch.options import (
    CONFIG_SCHEMA,
    FORMATS,
    RECIPES,
    ExecuTorchOptions,
)

build_executorch_pipeline = lazy_builder(
    "graphbuild.targets.executorch.pipeline", "build_executorch_pipeline"
)

TARGET = Target(
    name="executorch",
    description="ExecuTorch .pte: XNNPACK-delegated (xnnpack), portable kernels, or Arm VGF",
    formats=FORMATS,
    options_type=ExecuTorchOptions,
    build_pipeline=build_executorch_pipeline,
    config_schema=CONFIG_SCHEMA,
    top_level_options=("recipe",),  # recipe = "..." beside model, in a file shared with qnn
    quantization_option="recipe",
    numerics_option="check_numerics",
)

__all__ = ["FORMATS", "RECIPES", "TARGET", "ExecuTorchOptions", "build_executorch_pipeline"]

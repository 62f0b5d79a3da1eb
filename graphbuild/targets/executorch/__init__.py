"""The ExecuTorch target: a ``.pte`` program for ExecuTorch's runtime, XNNPACK-delegated
(``xnnpack``), on portable kernels (``portable``) or through Arm's VGF flow (``vgf``).

It shares the torch.export front end (and the ``capture`` cache entries) with the QNN target.
Importing this package declares the target only; ``executorch`` is imported by its stages and
is an optional extra: ``pip install 'graphbuild[executorch]'``.
"""

from __future__ import annotations

from typing import Any

from graphbuild.targets.base import Request, Target
from graphbuild.targets.executorch.options import (
    CONFIG_SCHEMA,
    FORMATS,
    RECIPES,
    ExecuTorchOptions,
)


def build_executorch_pipeline(request: Request, fmt: str | None = None) -> Any:
    """The ExecuTorch pipeline for ``request`` (see ``graphbuild.targets.executorch.pipeline``)."""
    from graphbuild.targets.executorch.pipeline import build_executorch_pipeline as build

    return build(request, fmt)


TARGET = Target(
    name="executorch",
    description="ExecuTorch .pte: XNNPACK-delegated (xnnpack), portable kernels, or Arm VGF",
    formats=FORMATS,
    options_type=ExecuTorchOptions,
    build_pipeline=build_executorch_pipeline,
    config_schema=CONFIG_SCHEMA,
)

__all__ = ["FORMATS", "RECIPES", "TARGET", "ExecuTorchOptions", "build_executorch_pipeline"]

"""Is QNN's HTP backend usable here (and if not, why), which versions prepare graphs, and the
execution provider's options for an HTP architecture and SoC model."""

from __future__ import annotations

import platform
import sys
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from graphbuild.targets.qnn.arch.targets import SOC_MODELS, HtpTarget
from graphbuild.targets.qnn.htp_runtime.errors import HtpUnavailableError
from graphbuild.targets.qnn.htp_runtime.intercept import intercepted_output
from graphbuild.targets.qnn.htp_runtime.partition import QNN_EP

__all__ = [
    "INSTALL",
    "SOC_MODELS",
    "Availability",
    "HtpTarget",
    "availability",
    "backend_versions",
    "ep_options_for",
    "qnn_devices",
    "require_backend",
]

INSTALL = (
    "install the htp extra: pip install 'graphbuild[htp]' (onnxruntime-qnn 2.7, which ships "
    "QNN's HTP backend for Linux x86_64 and Windows on ARM64 and needs onnxruntime >= 1.24.2)"
)


@dataclass(frozen=True)
class Availability:
    """Whether QNN's HTP backend can run here; ``reason`` says why not (and what to do)."""

    available: bool
    reason: str = ""


_register_lock = threading.Lock()


@cache
def availability() -> Availability:
    """Import onnxruntime-qnn and register its execution provider (once per process)."""
    try:
        import onnxruntime as ort
    except ImportError as exc:  # pragma: no cover - onnxruntime is a dependency
        return Availability(False, f"onnxruntime does not import ({exc}); {INSTALL}")
    try:
        import onnxruntime_qnn
    except ImportError as exc:
        where = f"{sys.platform}/{platform.machine()}"
        return Availability(
            False, f"onnxruntime-qnn is not installed ({exc}) on {where}; {INSTALL}"
        )
    if not hasattr(ort, "register_execution_provider_library"):
        return Availability(
            False,
            f"onnxruntime {ort.__version__} has no plugin execution providers; {INSTALL}",
        )
    htp = Path(onnxruntime_qnn.get_qnn_htp_path())
    if not htp.is_file():
        return Availability(
            False,
            f"onnxruntime-qnn {onnxruntime_qnn.__version__} has no HTP backend for "
            f"{sys.platform}/{platform.machine()} ({htp.name} missing); {INSTALL}",
        )
    with _register_lock, intercepted_output():
        try:
            if not qnn_devices(ort):
                ort.register_execution_provider_library(QNN_EP, onnxruntime_qnn.get_library_path())
        except Exception as exc:  # onnxruntime raises its own Fail/RuntimeError types
            return Availability(False, f"onnxruntime could not load QNN's provider: {exc}")
        if not qnn_devices(ort):
            return Availability(False, f"onnxruntime-qnn registered no {QNN_EP} device here")
    return Availability(True)


def qnn_devices(ort: Any) -> list[Any]:
    return [d for d in ort.get_ep_devices() if d.ep_name == QNN_EP]


def require_backend() -> None:
    """Raise :class:`HtpUnavailableError` (with the reason) where the backend is unusable."""
    found = availability()
    if not found.available:
        raise HtpUnavailableError(f"QNN's HTP backend is not available: {found.reason}")


@cache
def backend_versions() -> dict[str, str]:
    """What prepares and runs an HTP graph here: onnxruntime, onnxruntime-qnn and the QNN SDK
    its backend was built from. A stage that runs the backend keys on these."""
    require_backend()
    import onnxruntime as ort
    import onnxruntime_qnn

    info = getattr(onnxruntime_qnn, "build_and_package_info", None)
    return {
        "onnxruntime": ort.__version__,
        "onnxruntime_qnn": onnxruntime_qnn.__version__,
        "qnn_sdk": str(getattr(info, "qnn_version", "unknown")),
    }


def ep_options_for(target: HtpTarget) -> dict[str, str]:
    """QNN EP's options for an HTP session on ``target``."""
    import onnxruntime_qnn

    return {
        "backend_path": onnxruntime_qnn.get_qnn_htp_path(),
        "htp_arch": target.htp_arch,
        "soc_model": target.soc_model,
    }

"""The config the sweep tests share: the tiny decoder and three named calibration sets."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DECODER = ROOT / "examples" / "tiny_decoder.py"


def write_config(directory: Path, *, lease_seconds: float | None = None) -> Path:
    """``directory/graphbuild.toml`` naming the tiny decoder (w8a16 by default) and the
    calibration sets ``default``, ``large`` and ``narrow``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "graphbuild.toml"
    text = (
        f'model = "{DECODER}:build"\n'
        f'calibration = "{DECODER}:calibration"\n'
        'model_name = "tiny_decoder"\n'
        "[quantization]\n"
        'preset = "w8a16"\n'
        "[sweep.calibrations]\n"
        f'default = "{DECODER}:calibration"\n'
        f'large = "{DECODER}:calibration_large"\n'
        f'narrow = "{DECODER}:calibration_narrow"\n'
    )
    if lease_seconds is not None:
        text += f"[cache]\nlease_seconds = {lease_seconds}\n"
    path.write_text(text)
    return path

"""The HTP architectures and SoC models a QNN export is checked and prepared for.

An HTP architecture (``htp_arch``: v68 to v81) is the Hexagon generation QNN prepares a graph
for; the SoC model (QNN's numeric id) pins the chip, and with it the VTCM size graph
finalization plans for. The default architecture is the one of the HTP configuration the
presets follow (``htp_v81``: v81), each architecture's default SoC its flagship Snapdragon.
Cheap to import: the qnn target's options validate against it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from graphbuild.errors import ConfigError
from graphbuild.targets.qnn.rules.config import CONFIG_NAME

__all__ = ["SOC_MODELS", "HtpTarget", "default_arch", "parse_targets"]

#: The SoC model each HTP architecture is prepared for by default (QNN's SoC ids: SM8350,
#: SM8450, SM8550, SM8650, SM8750, SM8850). Without a SoC model some graphs fail to finalize.
SOC_MODELS: Mapping[str, str] = {
    "68": "30",
    "69": "36",
    "73": "43",
    "75": "57",
    "79": "69",
    "81": "87",
}


#: Architectures whose 16x16 MatMul refuses an int16 second input.
_NO_INT16_MATMUL_INPUT = frozenset({"68", "69"})


@dataclass(frozen=True)
class HtpTarget:
    """An HTP architecture (``"81"`` for v81) and the SoC model QNN prepares graphs for."""

    htp_arch: str
    soc_model: str

    @classmethod
    def of(cls, htp_arch: str | int, soc_model: str | int | None = None) -> HtpTarget:
        """From ``81``, ``"81"`` or ``"v81"``; the SoC model defaults to the arch's
        (:data:`SOC_MODELS`)."""
        arch = str(htp_arch).strip().lower().removeprefix("v")
        if arch not in SOC_MODELS:
            raise ConfigError(
                f"unknown HTP architecture {htp_arch!r}; supported: "
                + ", ".join(f"v{a}" for a in SOC_MODELS)
            )
        soc = SOC_MODELS[arch] if soc_model is None else str(soc_model).strip()
        if not soc.isdigit():
            raise ConfigError(f"soc_model must be QNN's numeric SoC id, not {soc_model!r}")
        return cls(arch, soc)

    def __str__(self) -> str:
        return f"v{self.htp_arch} (SoC {self.soc_model})"

    @property
    def takes_int16_matmul_input(self) -> bool:
        """False for v68 and v69: QNN refuses a 16x16 MatMul whose second input is int16
        ("Failed to add fused Matmul node"), measured with QNN 2.51's HTP."""
        return self.htp_arch not in _NO_INT16_MATMUL_INPUT

    @property
    def label(self) -> str:
        """``v81`` (the arch's default SoC) or ``v81_soc57``: names stages, files, reports."""
        if SOC_MODELS.get(self.htp_arch) == self.soc_model:
            return f"v{self.htp_arch}"
        return f"v{self.htp_arch}_soc{self.soc_model}"


def default_arch() -> str:
    """The architecture of the HTP configuration the presets follow (``htp_v81``: ``81``)."""
    return CONFIG_NAME.rpartition("_v")[2]


def parse_targets(
    htp_arch: str | int | Sequence[str | int] | None,
    soc_model: str | int | Sequence[str | int] | None = None,
) -> tuple[HtpTarget, ...]:
    """The targets an option pair names: one arch or a list, with one SoC model, a list of the
    same length, or None (each arch's default); no arch gives :func:`default_arch`."""
    archs = _as_list(htp_arch) or [default_arch()]
    socs = _as_list(soc_model)
    if len(socs) > 1 and len(socs) != len(archs):
        raise ConfigError(
            f"soc_model lists {len(socs)} SoC models for {len(archs)} HTP architectures; "
            "give one per architecture, or one for all"
        )
    if len(socs) == 1 and len(archs) > 1:
        raise ConfigError(
            "one soc_model for several HTP architectures: a SoC has one architecture; "
            "give one SoC model per architecture, or none for each one's default"
        )
    targets = tuple(HtpTarget.of(a, socs[i] if socs else None) for i, a in enumerate(archs))
    repeated = sorted({t.label for t in targets if targets.count(t) > 1})
    if repeated:
        raise ConfigError(f"HTP target(s) given more than once: {', '.join(repeated)}")
    return targets


def _as_list(value: str | int | Sequence[str | int] | None) -> list[str | int]:
    if value is None:
        return []
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        return [value]
    if isinstance(value, Sequence) and all(
        isinstance(v, (str, int)) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    raise ConfigError(f"expected a string, an integer or a list of them, not {value!r}")

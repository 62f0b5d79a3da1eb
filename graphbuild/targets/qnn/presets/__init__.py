"""The QNN presets (``w8a8``, ``w8a16``, ``w4a16``, ``w4a16_lpbq``) for torchao PT2E: the
quantizer that annotates what the HTP rules quantize (:mod:`.quantizer`), its observers on
AIMET's grids (:mod:`.observers`), LPBQ weights (:mod:`.lpbq_weights`) and per-layer
overrides (:mod:`.overrides`). Importing this package imports none of them (no torchao)."""

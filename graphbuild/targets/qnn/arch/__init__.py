"""What a QNN export is prepared for: the HTP architectures and SoC models
(:mod:`.targets`). Cheap to import: the qnn target's options validate against it."""

"""graphbuild: incremental export of quantized PyTorch models."""

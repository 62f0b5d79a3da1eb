"""The torch.export front end: capture, PT2E quantization, quantizer normalization to
markers, and the quant map that ties markers to their values."""

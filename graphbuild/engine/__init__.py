"""The build engine: pipelines of stages, fingerprints, keys, codecs and the scheduler.

Nothing here knows about torch.export, ONNX or any target; everything above builds on it.
"""

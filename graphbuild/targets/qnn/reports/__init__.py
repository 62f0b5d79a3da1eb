"""What an export reports about itself: the coverage report (:mod:`.coverage`: does it
quantize what QNN HTP runs quantized, and why not where it does not), the known defects of
QNN's HTP backend it names (:mod:`.defects`), and the numerics check (:mod:`.numerics`:
onnxruntime against the quantized torch model)."""

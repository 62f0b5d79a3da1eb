"""QNN encodings: write them (1.0.0, 0.6.1, 2.0.0), read them back, and put them back into ONNX.

- :mod:`.write`: the document for a quant map and its current values (:func:`build_encodings`,
  each version's entries by :mod:`.formats`), and its text (:mod:`.text`:
  :func:`dumps_encodings`);
- :mod:`.read`: the inverse (:func:`read_encodings`);
- :mod:`.reinsert`: float quantize-dequantize chains in the float ONNX graph from a document
  alone (:func:`insert_fake_quant`), for the numerics check.
"""

from graphbuild.targets.qnn.encodings.grid import DEFAULT_VERSION, VERSIONS
from graphbuild.targets.qnn.encodings.read import TensorEncoding, read_encodings
from graphbuild.targets.qnn.encodings.reinsert import insert_fake_quant
from graphbuild.targets.qnn.encodings.text import dumps_encodings
from graphbuild.targets.qnn.encodings.write import build_encodings

__all__ = [
    "DEFAULT_VERSION",
    "VERSIONS",
    "TensorEncoding",
    "build_encodings",
    "dumps_encodings",
    "insert_fake_quant",
    "read_encodings",
]

"""The HTP rules: which tensors QNN HTP runs quantized, and how (AIMET's ``htp_v81``
semantics), over a small graph view.

- :mod:`.plan`: the rules themselves (:func:`~.plan.plan`: a :class:`~.plan.TensorRule` per
  tensor);
- :mod:`.config`: AIMET's configuration file (``htp_v81.json``) and what AIMET keeps in code
  about it;
- :mod:`.groups`: what spans ops (graph passes, supergroups, shared encodings), over the
  quantizers of :mod:`.quantizers`;
- :mod:`.view`: the graph view the rules read; :mod:`.aten_view` and :mod:`.onnx_view` build
  it from an aten graph (the preset) and from an exported ONNX model (the coverage report).
"""

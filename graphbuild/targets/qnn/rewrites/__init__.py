"""Graph rewrites for QNN's HTP: value-independent, each keeping the function.

- Before the preset annotates, on the aten graph (:mod:`.aten`: :func:`~.aten.rewrite_for_htp`):
  in-place ops made out-of-place, Python numbers lifted to constants, integer arithmetic on
  static shapes folded into its float constant (:mod:`.constants`), the
  :mod:`.decompositions` of ops the exporter lowers to several ONNX ops, and the
  :mod:`.patterns` QNN's HTP refuses or computes wrong; :mod:`.emitter` builds their nodes.
- After lowering, on a QDQ model (:mod:`.qdq_forms`: :func:`~.qdq_forms.apply_htp_forms`):
  the Q/DQ forms the HTP runs fully quantized, LayerNorm's int32 bias in :mod:`.qdq_bias`.
"""

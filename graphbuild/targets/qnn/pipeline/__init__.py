"""The qnn pipelines' stages and their wiring.

- :mod:`.build`: :func:`~.build.build_qnn_pipeline`, which wires every stage below;
- :mod:`.quantize`: the one-stage quantization (``quantize``, ``normalize``, ``quant_map``,
  ``qparams``, ``marker_graph``) of other quantizers and a model's own;
- :mod:`.placement` and :mod:`.values`: a built-in preset's quantization in three parts
  (``place_quantizers``, ``fold_weights``, ``weight_stats``, ``calibrate``, ``left_float``;
  ``quant_map``, ``quant_sites``, ``qparams``) and the stages after them that read its
  placement or statistics; :mod:`.site_rules`, ``layer_overrides`` and LPBQ as values;
- :mod:`.lower`: the ONNX model (``to_onnx``, ``lower_markers``, ``weight_digests``, ``bind``);
- :mod:`.outputs`: ``encodings``, ``htp_view`` and ``coverage``, ``reference`` and
  ``check_numerics``;
- :mod:`.htp`: the HTP check and the ``context`` format.
"""

"""The quantization map and the quantizer marker: the interface between front ends and formats.

A front end (``frontend/``) replaces every quantizer it recognises with a marker
(:mod:`~graphbuild.quant.markers`) and describes it in a
:class:`~graphbuild.quant.quantmap.QuantMap`; the formats (``onnx/``, ``targets/``) read
both. They live below every front end and format, so that no format depends on a front end's
package.
"""

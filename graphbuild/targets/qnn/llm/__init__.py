"""The ``qnn/llm`` format: a causal LM as prompt and token part graphs with a windowed uint8
KV cache, run by onnxruntime-genai's decoder pipeline or Qualcomm's Genie."""

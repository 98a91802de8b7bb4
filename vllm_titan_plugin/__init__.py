"""vLLM out-of-tree plugin: ``--model-impl titan`` serves the titan model definition."""

"""aiayn runtime: torch-free translation over the exported ONNX graphs."""

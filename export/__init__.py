"""``aiayn export`` / ``aiayn validate``: a PyTorch checkpoint becomes a validated ONNX model
package (DESIGN.md "The graph contract", "The model package").

graphs.py    trace ``encode_for_step`` / ``step`` with torch.export into encoder.onnx,
             decoder.onnx (and decoder_init.onnx for TensorRT)
variants.py  ORT offline optimization, float16 conversion, int8 dynamic quantization
validate.py  parity against PyTorch (shape grid, decoded sequence), parity.json
package.py   the pipeline: load -> trace -> variant -> manifest -> validate -> atomic save
tensorrt.py  TensorRT engines (.plan) for the tensorrt variant (unverified: no TensorRT here)
cli.py       the ``export`` and ``validate`` subcommands
parity.py    ``aiayn parity``: PyTorch reference vs a package over a test split
"""

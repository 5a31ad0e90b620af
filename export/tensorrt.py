"""TensorRT engines for the ``tensorrt`` package variant (``aiayn export --tensorrt``).

UNVERIFIED: TensorRT cannot be installed where this was written; the code follows the
documented TensorRT 10 Python API (``trt.Builder``, ``OnnxParser.parse_from_file``,
``IOptimizationProfile.set_shape`` / ``set_shape_input``, ``IBuilderConfig`` flags and timing
cache, ``build_serialized_network``; at run time ``set_input_shape`` / ``set_tensor_address`` /
``execute_async_v3``) and has never run. Its tests are marked ``gpu`` and skip without
TensorRT.

DESIGN.md "The graph contract": TensorRT forbids zero-length dimensions, so the package adds
``decoder_init.onnx`` (the first step, no past) and ``decoder.onnx``'s optimization profile
starts at P = 1. Engines are built in fp16 with LayerNorm (INormalizationLayer), softmax and
top-k pinned to fp32 (``OBEY_PRECISION_CONSTRAINTS``), and with float16 caches and cross K/V at
their inputs/outputs as the contract's fp16 variants have them (log_probs, topk_log_probs and
cross_attn stay float32). One timing cache is shared by the three builds and saved in the
package (and to ``timing_cache`` when given). An engine runs only on the GPU model and
TensorRT version that built it: both go into the manifest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime import contract as C
from runtime.checksums import sha256_file

from .errors import ExportError

ENGINE_FILES = {"encoder": C.ENCODER_ENGINE, "decoder": C.DECODER_ENGINE,
                "decoder_init": C.DECODER_INIT_ENGINE}
# Engine I/O in float16 (the contract's fp16 variant); everything else keeps its ONNX dtype.
FP16_IO = ("past_k", "past_v", "cross_k", "cross_v", "present_k", "present_v")
INSTALL_HINT = ("pip install tensorrt (or pip install 'aiayn[gpu]') on the machine whose GPU "
                "will run the engines")


def require_tensorrt():
    """Import TensorRT (>= 10) or raise ExportError naming the package to install."""
    try:
        import tensorrt as trt
    except ImportError:
        raise ExportError("--tensorrt needs NVIDIA TensorRT's Python package `tensorrt`, which "
                          f"is not installed: {INSTALL_HINT}") from None
    try:
        major = int(trt.__version__.split(".")[0])
    except (AttributeError, ValueError):
        major = 0
    if major < 10:
        raise ExportError(f"--tensorrt needs TensorRT >= 10, found "
                          f"{getattr(trt, '__version__', '?')}: {INSTALL_HINT}")
    return trt


@dataclass(frozen=True)
class EngineShapes:
    """min / opt / max of the dynamic axes in every optimization profile.

    rows: B (encoder) and N, N_prev (decoder rows = sentences x beam); source: S; past: P
    (decoder.onnx only, from 1); topk: values of the ``topk`` shape input. ``None`` maxima
    default to the model's ``max_positions``.
    """

    rows: tuple[int, int, int] = (1, 16, 128)
    source: tuple[int, int, int | None] = (1, 32, None)
    past: tuple[int, int, int | None] = (1, 32, None)
    topk: tuple[int, int, int] = (1, 10, 64)
    step: tuple[int, int, int | None] = (0, 32, None)

    def resolved(self, cfg) -> dict[str, tuple[int, int, int]]:
        def fix(t, hi):
            lo, opt, mx = t
            mx = hi if mx is None else min(mx, hi)
            return (min(lo, mx), min(opt, mx), mx)

        return {"rows": fix(self.rows, 1 << 20), "source": fix(self.source, cfg.max_positions),
                "past": fix(self.past, cfg.max_positions - 1),
                "topk": fix(self.topk, cfg.vocab_size),
                "step": fix(self.step, cfg.max_positions - 1)}


def _axis_ranges(cfg, ranges: dict[str, tuple[int, int, int]]) -> dict[str, tuple[int, int, int]]:
    fixed = {"L": cfg.decoder_layers, "H": cfg.h, "Dh": cfg.d_k, "V": cfg.vocab_size}
    out = {k: (v, v, v) for k, v in fixed.items()}
    out.update({"B": ranges["rows"], "N": ranges["rows"], "N_prev": ranges["rows"],
                "S": ranges["source"], "P": ranges["past"]})
    return out


def profile_shapes(specs: tuple[C.TensorSpec, ...], cfg, ranges) -> dict[str, dict[str, list]]:
    """{input: {"min", "opt", "max"}} shapes of one graph's profile, from the contract's axes."""
    axes = _axis_ranges(cfg, ranges)
    out = {}
    for s in specs:
        if not s.axes:
            continue
        out[s.name] = {k: [axes[a][i] for a in s.axes] for i, k in enumerate(("min", "opt", "max"))}
    return out


def gpu_name() -> str:
    """The name of CUDA device 0 (torch if it sees CUDA, else nvidia-smi), or "unknown"."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            res = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30, check=True)
            return res.stdout.strip().splitlines()[0]
        except (subprocess.SubprocessError, IndexError, OSError):
            pass
    return "unknown"


def fold_topk(onnx_path: Path, k: int) -> Path:
    """A copy of ``onnx_path`` (beside it, sharing its external data) whose ``topk`` input is
    the constant ``k``: for TensorRT parsers that accept only a constant TopK K."""
    import onnx
    from onnx import helper

    model = onnx.load(str(onnx_path), load_external_data=False)
    inputs = [i for i in model.graph.input if i.name != "topk"]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    model.graph.initializer.append(helper.make_tensor("topk", onnx.TensorProto.INT64, [], [k]))
    out = onnx_path.with_name(f".{onnx_path.stem}.topk{k}.onnx")
    onnx.save(model, str(out))
    return out


def _parse(trt, builder, onnx_path: Path, logger):
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if parser.parse_from_file(str(onnx_path)):  # resolves external data beside the file
        return network, None
    return None, "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))


def build_engine(trt, onnx_path: Path, engine_path: Path, specs: tuple[C.TensorSpec, ...], cfg,
                 ranges, timing_cache, logger) -> dict[str, Any]:
    """Parse one ONNX graph and build its fp16 engine into ``engine_path``.

    If the parser refuses a TopK whose K is the ``topk`` input (TensorRT supports only a
    constant K in some versions), the graph is rebuilt with ``topk`` fixed to the profile's
    ``opt`` value (the runtime's 2K + 2 at K = 4 by default); the entry then records
    ``topk_fixed`` and the engine has no ``topk`` input. Raises ExportError with the parser's
    or builder's errors.
    """
    builder = trt.Builder(logger)
    if builder is None:
        raise ExportError("TensorRT could not create a builder: no usable CUDA GPU here?")
    network, errors = _parse(trt, builder, onnx_path, logger)
    topk_fixed = None
    if network is None and "topk" in C.names(specs) and "TopK" in (errors or ""):
        topk_fixed = ranges["topk"][1]
        folded = fold_topk(onnx_path, topk_fixed)
        try:
            network, errors = _parse(trt, builder, folded, logger)
        finally:
            folded.unlink()
        specs = tuple(s for s in specs if s.name != "topk")
    if network is None:
        raise ExportError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {errors}")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 4 << 30)
    if not builder.platform_has_fast_fp16:
        raise ExportError("this GPU has no fast fp16; the TensorRT variant is built in fp16")
    config.set_flag(trt.BuilderFlag.FP16)
    config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
    config.set_timing_cache(timing_cache, False)

    pinned = 0
    keep_fp32 = {trt.LayerType.NORMALIZATION, trt.LayerType.SOFTMAX, trt.LayerType.TOPK}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type in keep_fp32:
            layer.precision = trt.float32
            for j in range(layer.num_outputs):
                if layer.get_output(j).dtype in (trt.float32, trt.float16):
                    layer.set_output_type(j, trt.float32)
            pinned += 1
    for tensors in ([network.get_input(i) for i in range(network.num_inputs)],
                    [network.get_output(i) for i in range(network.num_outputs)]):
        for t in tensors:
            if t.name in FP16_IO:
                t.dtype = trt.float16

    profile = builder.create_optimization_profile()
    shapes = profile_shapes(specs, cfg, ranges)
    shape_inputs = {}
    for i in range(network.num_inputs):
        t = network.get_input(i)
        if t.is_shape_tensor:  # a value that sets a shape (topk: the TopK's K)
            lo, opt, hi = ranges["topk"] if t.name == "topk" else ranges["step"]
            profile.set_shape_input(t.name, [lo], [opt], [hi])
            shape_inputs[t.name] = {"min": lo, "opt": opt, "max": hi}
        elif t.name in shapes:
            s = shapes[t.name]
            profile.set_shape(t.name, s["min"], s["opt"], s["max"])
    config.add_optimization_profile(profile)

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(f"TensorRT failed to build an engine for {onnx_path.name} (see the "
                          "TensorRT log above)")
    engine_path.write_bytes(bytes(serialized))
    entry = {"file": engine_path.name, "sha256": sha256_file(engine_path), "precision": "fp16",
             "fp32_layers": pinned,
             "fp16_io": [n for n in FP16_IO if any(s.name == n for s in specs)],
             "profiles": [{"shapes": shapes, "shape_inputs": shape_inputs}]}
    if topk_fixed is not None:
        entry["topk_fixed"] = topk_fixed
    return entry


def build_engines(trt, package_dir: Path, manifest: dict[str, Any], model,
                  timing_cache: str | os.PathLike | None = None, shapes: EngineShapes | None = None,
                  seed: int = 0, progress=None) -> dict[str, Any]:
    """Build ``encoder.plan``, ``decoder_init.plan`` and ``decoder.plan`` from the package's
    ONNX graphs, check them against PyTorch (``check_engines``) and return the manifest with
    ``engines``, ``tensorrt_version``, ``gpu_name`` and a ``tensorrt`` record added.

    Raises ExportError if a build fails, ParityError if an engine fails its check.
    """
    say = progress or (lambda _msg: None)
    cfg = model.cfg
    ranges = (shapes or EngineShapes()).resolved(cfg)
    logger = trt.Logger(trt.Logger.WARNING)
    cache_src = Path(timing_cache) if timing_cache else None
    blob = cache_src.read_bytes() if cache_src and cache_src.is_file() else b""
    probe = trt.Builder(logger)
    if probe is None:
        raise ExportError("TensorRT could not create a builder: no usable CUDA GPU here?")
    cache = probe.create_builder_config().create_timing_cache(blob)
    specs = {"encoder": C.ENCODER_INPUTS, "decoder": C.DECODER_INPUTS,
             "decoder_init": C.DECODER_INIT_INPUTS}
    engines = {}
    for name in ("encoder", "decoder_init", "decoder"):
        onnx_path = package_dir / manifest["graphs"][name]["file"]
        say(f"building TensorRT engine {ENGINE_FILES[name]} (fp16; this takes minutes)")
        engines[name] = build_engine(trt, onnx_path, package_dir / ENGINE_FILES[name],
                                     specs[name], cfg, ranges, cache, logger)
    cache_bytes = bytes(cache.serialize())
    (package_dir / C.TIMING_CACHE_FILE).write_bytes(cache_bytes)
    if cache_src:
        cache_src.write_bytes(cache_bytes)
    manifest = {**manifest, "engines": engines, "tensorrt_version": trt.__version__,
                "gpu_name": gpu_name(),
                "tensorrt": {"timing_cache": C.TIMING_CACHE_FILE, "ranges": ranges,
                             "fp32_layer_types": ["NORMALIZATION", "SOFTMAX", "TOPK"],
                             "note": "engines run only on this GPU model with this TensorRT "
                                     "version; rebuild elsewhere with aiayn export --tensorrt"}}
    report = check_engines(trt, package_dir, engines, model, seed=seed, progress=say)
    if report is not None:
        manifest["tensorrt"]["parity"] = report.summary()
    return manifest


# ---- running engines (for the check) -----------------------------------------------------------


class EngineRunner:
    """Runs one serialized engine on torch CUDA tensors; a validate.Runner."""

    def __init__(self, trt, path: Path):
        import torch

        self.trt, self.torch = trt, torch
        self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise ExportError(f"TensorRT could not load {path.name}")
        self.context = self.engine.create_execution_context()
        self.names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.dtypes = {trt.float32: torch.float32, trt.float16: torch.float16,
                       trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool}

    def __call__(self, feed: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        trt, torch, eng, ctx = self.trt, self.torch, self.engine, self.context
        keep = []
        inputs = [n for n in self.names if eng.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        for n in inputs:  # an engine built with topk_fixed has no topk input
            x = feed[n]
            x = torch.as_tensor(np.asarray(x)) if not hasattr(x, "detach") else x.detach()
            x = x.to(self.dtypes[eng.get_tensor_dtype(n)]).contiguous()
            if eng.get_tensor_location(n) == trt.TensorLocation.HOST:  # shape tensor (topk)
                x = x.cpu()
            else:
                x = x.cuda()
                ctx.set_input_shape(n, tuple(x.shape))
            ctx.set_tensor_address(n, x.data_ptr())
            keep.append(x)
        outputs = {}
        for n in self.names:
            if eng.get_tensor_mode(n) != trt.TensorIOMode.OUTPUT:
                continue
            shape = tuple(ctx.get_tensor_shape(n))
            outputs[n] = torch.empty(shape, dtype=self.dtypes[eng.get_tensor_dtype(n)],
                                     device="cuda")
            ctx.set_tensor_address(n, outputs[n].data_ptr())
        stream = torch.cuda.current_stream()
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise ExportError("TensorRT engine execution failed")
        stream.synchronize()
        return {n: t.float().cpu().numpy() if t.is_floating_point() else t.cpu().numpy()
                for n, t in outputs.items()}


def check_engines(trt, package_dir: Path, engines: dict[str, Any], model, seed: int = 0,
                  progress=None):
    """Engine parity against PyTorch with the fp16 tolerances (export/validate.py), P >= 1.

    Needs torch with CUDA; without it the check is skipped (None returned, a line says so).
    Raises ParityError if an engine fails.
    """
    from .validate import validate_runners

    say = progress or (lambda _msg: None)
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        say("TensorRT engines NOT checked: torch here has no CUDA (check them with "
            "`aiayn parity --backend tensorrt` on this GPU)")
        return None
    runners = {name: EngineRunner(trt, package_dir / e["file"]) for name, e in engines.items()}
    fixed = {e["topk_fixed"] for e in engines.values() if "topk_fixed" in e}
    report = validate_runners(model, runners, "fp16", "tensorrt", seed=seed, min_past=1,
                              fixed_topk=fixed.pop() if fixed else None, progress=say)
    for line in report.lines():
        say(f"tensorrt {line}")
    report.raise_if_failed()
    return report


"""``tokenq bench quant``: quantized weights on the quantized kernels against the float paths.

Four sections, each a table: ``kernels`` (each format's quantized product, on the path its
row count takes, against dequantize-then-matmul, the float32 weight packed as the engine
packs it; the K-quants at shapes of whole super-blocks), ``passes`` (the model's own layers,
one pass over all of them per row count, quantized against float32), ``engine`` (W1 and W2,
a row per path: the file's blocks on the quantized kernels, the default, then float32 and
bfloat16 dequantized; on the default model's Q4_1 file and on a Q8_0 file written from it
with the ``gguf`` package) and ``accuracy`` (teacher-forced next-token distributions over
the repository's own docs, the quantized path against the same file dequantized to float32;
``--folder`` adds ``--quantization int8`` on a safetensors folder against its float32 run).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tokenq.bench.common import warm_up
from tokenq.bench.engine import run_engine, save_hf_folder, w1, w2
from tokenq.bench.teacher_forcing import agreement, engine_logits
from tokenq.engine.config import EngineConfig
from tokenq.engine.downloads import DEFAULT_MODEL, build_dir
from tokenq.engine.linear import Linear
from tokenq.engine.llm import LLM
from tokenq.engine.llm_engine import LLMEngine
from tokenq.engine.loader import load_checkpoint, resolve_model
from tokenq.kernels import cpu_ops, cpu_quant

REPO = Path(__file__).resolve().parents[2]
# (path name, engine options)
PATHS = {
    "quantized": {"dtype": "float32", "quantization": "gguf"},
    "float32": {"dtype": "float32", "quantization": "none"},
    "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
}


def requantize(src: Path, dst: Path, qtype: str = "Q8_0") -> Path:
    """``src`` with every matrix quantized to ``qtype`` (from its dequantized values),
    metadata and vectors as they are."""
    import gguf

    target = gguf.GGMLQuantizationType[qtype]

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), arch=None)  # the architecture is among the fields
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.alignment":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for tensor in reader.tensors:
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
        values = gguf.quants.dequantize(tensor.data, qtype)
        if values.ndim < 2:
            writer.add_tensor(tensor.name, values.astype(np.float32))
            continue
        data = gguf.quants.quantize(values.astype(np.float32), target)
        writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _time_us(fn: Callable[[], object], repeats: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


# (weight rows, columns) per format: the default model's MLP shapes, and for the K-quants
# (rows of whole 256-value super-blocks) Gemma 3 270M's down and o projections.
KERNEL_SHAPES = {32: [(1536, 576), (576, 1536)], 256: [(640, 2048), (640, 1024)]}


def random_weight(
    qtype: int, n: int, k: int, gen: np.random.Generator
) -> cpu_quant.QuantizedWeight:
    """A random ``[n, k]`` weight in ``qtype``: quantized by the ``gguf`` package where it
    can, else (the K-quants) random blocks under float16 scales in (0.001, 0.02]."""
    import gguf

    fmt = cpu_quant.QTYPES[qtype]
    if fmt.values == 32:
        w = gen.standard_normal((n, k), dtype=np.float32)
        data = gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
        return cpu_quant.QuantizedWeight(torch.from_numpy(np.ascontiguousarray(data)), qtype, k)
    blocks = gen.integers(0, 256, (n, k // fmt.values, fmt.bytes), dtype=np.uint8)
    scale = gen.uniform(0.001, 0.02, (n, k // fmt.values, 1)).astype(np.float16).view(np.uint8)
    at = (208,) if fmt.name == "Q6_K" else (0, 2)  # d (Q6_K's last), else d and dmin first
    for offset in at:
        blocks[:, :, offset : offset + 2] = scale
    return cpu_quant.QuantizedWeight(torch.from_numpy(blocks.reshape(n, -1)), qtype, k)


def kernels(rows: list[int]) -> None:
    """Each format's quantized product against the float32 product on the dequantized
    weight."""
    print(
        f"{'format':<7}{'isa':<12}{'path':<11}{'m x n x k':<20}{'quant us':>10}{'fp32 us':>10}"
        f"{'speedup':>9}"
    )
    gen = np.random.default_rng(0)
    for qtype, fmt in cpu_quant.QTYPES.items():
        for n, k in KERNEL_SHAPES[fmt.values]:
            qw = random_weight(qtype, n, k, gen)
            ref = Linear(qw.dequantize())
            for m in rows:
                x = torch.randn(m, k)
                ours = _time_us(lambda x=x, qw=qw: cpu_quant.quant_matmul(x, qw))
                theirs = _time_us(lambda x=x, ref=ref: ref(x))
                print(
                    f"{fmt.name:<7}{cpu_quant.isa():<12}{cpu_quant.path_for(m):<11}"
                    f"{f'{m}x{n}x{k}':<20}{ours:>10.1f}{theirs:>10.1f}{theirs / ours:>8.2f}x",
                    flush=True,
                )


def passes(model: Path, rows: list[int], repeats: int = 3) -> None:
    """A pass over every linear layer of ``model`` and its lm_head at each row count, on the
    file's blocks and on the float32 weights the default loads, as a decode step makes them:
    each weight read once per pass, so what does not fit in cache comes from memory (the
    kernel section times one weight, kept in cache)."""
    layers = {}
    for name, options in (("quantized", PATHS["quantized"]), ("float32", PATHS["float32"])):
        config = EngineConfig(
            model=str(model), device="cpu", num_kv_blocks=16, max_model_len=256, **options
        )
        net = LLMEngine(config).model_runner.model
        layers[name] = [
            lin
            for layer in net.layers
            for lin in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)
        ] + [net.lm_head]
    print(f"{'rows':>5}{'quantized ms':>14}{'float32 ms':>12}{'speedup':>9}  (one pass, best of 3)")
    for m in rows:
        best = {}
        for name, lins in layers.items():
            inputs = [torch.randn(m, lin.in_features) for lin in lins]
            times = []
            for _ in range(repeats + 1):  # the first warms the buffers
                start = time.perf_counter()
                for lin, x in zip(lins, inputs, strict=True):
                    lin(x)
                times.append(time.perf_counter() - start)
            best[name] = min(times[1:]) * 1e3
        q, f = best["quantized"], best["float32"]
        print(f"{m:>5}{q:>14.2f}{f:>12.2f}{f / q:>8.2f}x", flush=True)


def engine_rows(files: dict[str, Path], workloads: list, base: dict) -> None:
    print(f"{'file':<7}{'path':<11}{'workload':<22}{'tok/s':>9}{'vs fp32':>9}")
    for label, path in files.items():
        rates: dict[tuple[str, str], float] = {}
        for name, options in PATHS.items():
            llm = LLM(str(path), **(base | options))
            for wl in workloads:
                warm_up(llm.engine, wl.prompts)
                rate = wl.useful_tokens / run_engine(llm, wl)
                rates[(name, wl.name)] = rate
                fp32 = rates.get(("float32", wl.name))
                ratio = f"{rate / fp32:>8.2f}x" if fp32 else ""
                print(f"{label:<7}{name:<11}{wl.name:<22}{rate:>9.1f}{ratio:>9}", flush=True)
            del llm
        for wl in workloads:  # the quantized rows ran before their fp32 reference
            q, f = rates[("quantized", wl.name)], rates[("float32", wl.name)]
            print(f"{label:<7}{'quantized':<11}{wl.name:<22}{q:>9.1f}{q / f:>8.2f}x")


def docs_tokens(engine: LLMEngine, count: int) -> list[int]:
    text = "\n\n".join(
        p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    )
    return engine.tokenizer.encode(text)[:count]


def teacher_forced(
    model: str, reference: dict, other: dict, tokens: int, seq_len: int = 512
) -> None:
    base = {"device": "cpu", "num_kv_blocks": 2 * seq_len // 16 + 4, "max_model_len": seq_len}
    ref = LLMEngine(EngineConfig(model=model, **base, **reference))
    ids = docs_tokens(ref, tokens)
    seqs = [ids[i : i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    chunks = [seq_len // 2, seq_len // 4] + [1] * (seq_len - seq_len // 2 - seq_len // 4)

    def logits(engine: LLMEngine) -> torch.Tensor:
        return torch.cat([engine_logits(engine, [s], chunks) for s in seqs])

    ref_logits = logits(ref)
    del ref
    ours = logits(LLMEngine(EngineConfig(model=model, **base, **other)))
    print(f"{Path(model).name}: {other} against {reference}: {agreement(ref_logits, ours)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tokenq bench quant", description=__doc__)
    ap.add_argument("--section", default="kernels,passes,engine,accuracy", help="comma-separated")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a quantized GGUF (default model)")
    ap.add_argument("--requests", type=int, default=None, help="per workload (W1 32, W2 64)")
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--rows", default="1,8,32,512", help="activation rows (kernels, passes)")
    ap.add_argument("--tokens", type=int, default=4096, help="teacher-forced tokens of docs")
    ap.add_argument("--folder", help="a safetensors folder: also --quantization int8 on it")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_ops.load(build_dir()) is None or not cpu_quant.available():
        raise SystemExit("tokenq bench quant: the quantized kernels are not built here (no AVX2?)")
    sections = {s.strip() for s in args.section.split(",")}
    print(
        f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"quantized kernels: {cpu_quant.isa()}; torch {torch.__version__}",
        flush=True,
    )
    model = resolve_model(args.model) if sections & {"passes", "engine", "accuracy"} else None
    if "kernels" in sections:
        kernels([int(r) for r in args.rows.split(",")])
    if "passes" in sections:
        assert model is not None
        passes(model, [int(r) for r in args.rows.split(",")])
    if "engine" in sections:
        makers = {"W1": lambda: w1(args.requests or 32), "W2": lambda: w2(args.requests or 64)}
        workloads = [makers[w.strip().upper()]() for w in args.workloads.split(",")]
        base = {"device": "cpu", "num_threads": args.threads}
        assert model is not None
        with tempfile.TemporaryDirectory() as tmp:
            q8 = requantize(model, Path(tmp) / (model.stem.split(".")[0] + ".Q8_0.gguf"))
            engine_rows({"file": model, "Q8_0": q8}, workloads, base)
    if "accuracy" in sections:
        assert model is not None
        teacher_forced(str(model), PATHS["float32"], PATHS["quantized"], args.tokens)
        folder = args.folder
        with tempfile.TemporaryDirectory() as tmp:
            if folder is None:  # the default model's weights, dequantized, as a folder
                folder = os.path.join(tmp, "folder")
                save_hf_folder(str(model), Path(folder))
                load_checkpoint(model).tokenizer.save_pretrained(Path(folder))
            int8 = {"dtype": "float32", "quantization": "int8"}
            teacher_forced(folder, PATHS["float32"], int8, args.tokens)

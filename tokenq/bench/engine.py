"""``tokenq bench engine``: the engine against transformers ``generate`` (static batches, as
used offline) on the same weights and requests, a row per dtype; ``--vllm PYTHON`` adds vLLM's
CPU build, run by that interpreter (``vllm_side.py``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenq.bench.common import add_engine_options, engine_config, warm_up
from tokenq.bench.hf_reference import build_hf_model, greedy_config, require_transformers
from tokenq.engine.config import EngineConfig
from tokenq.engine.llm import LLM
from tokenq.kernels.cpu_features import bf16_speedup, bf16_support
from tokenq.protocol.params import SamplingParams


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.max_tokens)

    def warm_up(self) -> Workload:
        """The same prompts for two tokens each."""
        return Workload(self.name, self.prompts, [2] * len(self.prompts))


def w1(n: int = 32, prompt_len: int = 128, gen: int = 128) -> Workload:
    rng = random.Random(0)
    prompts = [[rng.randint(200, 40000) for _ in range(prompt_len)] for _ in range(n)]
    return Workload(f"W1 ({n}x{prompt_len}+{gen})", prompts, [gen] * n)


def w2(n: int = 64) -> Workload:
    rng = random.Random(0)
    prompts, max_tokens = [], []
    for _ in range(n):
        length = rng.randint(16, 512)
        prompts.append([rng.randint(200, 40000) for _ in range(length)])
        max_tokens.append(rng.randint(16, 256))
    return Workload(f"W2 ({n} mixed)", prompts, max_tokens)


def run_engine(llm: LLM, wl: Workload) -> float:
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for m in wl.max_tokens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == wl.useful_tokens
    return elapsed


def run_hf(model: torch.nn.Module, wl: Workload, batch_size: int, device: torch.device) -> float:
    start = time.perf_counter()
    for i in range(0, len(wl.prompts), batch_size):
        batch = wl.prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(wl.max_tokens[i : i + batch_size])
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=greedy_config(new),
            )
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_vllm(
    python: str, model_dir: Path, dtype: str, workloads: list[Workload], cfg: EngineConfig
) -> tuple[str, dict[str, float]]:
    """vLLM's version and its tok/s per workload, from ``vllm_side.py`` run by ``python``.
    It gets the cores tokenq's threads run on: by default it keeps one for itself, which
    on a 2-core machine halved it (W1 in bf16: 128 against 221 tok/s)."""
    spec = {
        "model": str(model_dir),
        "dtype": dtype,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "workloads": [
            {"name": w.name, "prompts": w.prompts, "max_tokens": w.max_tokens} for w in workloads
        ],
    }
    cpus = sorted(os.sched_getaffinity(0))[: torch.get_num_threads()]
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
        "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB: W1 and W2 need a fraction of it
        **os.environ,
        # the script's folder off sys.path: this package's queue.py would shadow the stdlib's
        "PYTHONSAFEPATH": "1",
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(spec, f)
        f.flush()
        cmd = [python, str(Path(__file__).with_name("vllm_side.py")), f.name]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or len(lines) != len(workloads) + 1:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise SystemExit(f"tokenq bench engine: vLLM ({python}) failed:\n{tail}")
    rates = {}
    for row, wl in zip(lines[1:], workloads, strict=True):
        if row["tokens"] != wl.useful_tokens:  # a rate over other work would compare nothing
            raise SystemExit(
                f"tokenq bench engine: vLLM generated {row['tokens']} tokens for {wl.name}, "
                f"not {wl.useful_tokens}"
            )
        rates[wl.name] = row["tokens"] / row["seconds"]
    return lines[0]["vllm"], rates


def save_hf_folder(model: str, folder: Path) -> None:
    """The engine's weights as a float32 transformers folder, for vLLM, which reads only
    those."""
    from tokenq.engine.loader import load_checkpoint, resolve_model

    checkpoint = load_checkpoint(resolve_model(model), torch.float32)
    require_transformers().utils.logging.disable_progress_bar()  # no bar in the table
    build_hf_model(checkpoint.config, checkpoint.weights).save_pretrained(folder)


def bench_dtypes(spec: str, device: torch.device) -> list[tuple[str, str]]:
    """The dtypes to run, each with a note for the table: ``auto``, every dtype this machine
    has hardware for, else a comma-separated list (a bf16 row that trails fp32 says why)."""
    if spec == "auto":
        names = ["bfloat16"] if device.type == "cuda" else ["float32"]
        if device.type == "cpu" and bf16_support().native:
            names.append("bfloat16")
    else:
        names = [n.strip() for n in spec.split(",") if n.strip()]
    out = []
    for name in names:
        EngineConfig(dtype=name)  # a clear error for a name that is no dtype
        out.append((name, cpu_bf16_note(name) if device.type == "cpu" else ""))
    return out


def cpu_bf16_note(dtype: str) -> str:
    """Why a CPU's bf16 row may trail its fp32 one: emulated, or slower instructions."""
    if dtype != "bfloat16":
        return ""
    if not bf16_support().native:
        return "no bf16 instructions: emulated"
    if EngineConfig(dtype="auto").resolved_dtype(torch.device("cpu")) != torch.bfloat16:
        return f"bf16 products at {bf16_speedup():.2f}x fp32's here: auto picks float32"
    return ""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="tokenq bench engine", description=__doc__)
    add_engine_options(ap, skip=("dtype",))
    ap.add_argument("--workloads", default="W1,W2", help="comma-separated: W1, W2")
    ap.add_argument("--scale", type=int, default=1, help="multiply request counts (GPU runs)")
    ap.add_argument(
        "--requests", type=int, default=None, help="requests per workload (W1 32, W2 64)"
    )
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true", help="run the engine side only")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="comma-separated dtypes, one table row each; auto: those the machine has "
        "hardware for (a CPU: float32, and bfloat16 with AVX512_BF16 or AMX)",
    )
    ap.add_argument(
        "--vllm",
        metavar="PYTHON",
        help="also run vLLM's CPU build with this interpreter (a venv with vllm-cpu)",
    )
    ap.add_argument("--vllm-dtype", default="bfloat16", help="comma-separated, for --vllm")
    args = ap.parse_args(argv)
    if not args.no_hf or args.vllm:
        try:
            require_transformers()
        except ModuleNotFoundError as exc:  # before minutes of loading: a line, exit 2
            print(
                f"tokenq bench engine: {exc}; or run the engine alone with --no-hf", file=sys.stderr
            )
            raise SystemExit(2) from None

    device = engine_config(args).resolved_device()
    try:
        dtypes = bench_dtypes(args.dtype, device)
    except ValueError as exc:
        ap.error(str(exc))
    makers = {
        "W1": lambda: w1((args.requests or 32) * args.scale),
        "W2": lambda: w2((args.requests or 64) * args.scale),
    }
    workloads = [makers[w.strip().upper()]() for w in args.workloads.split(",")]
    header = f"{'dtype':<10}{'workload':<22}{'tokens':>8}{'engine tok/s':>14}"
    print(header + f"{'HF tok/s':>10}{'ratio':>8}")
    ours: dict[tuple[str, str], float] = {}
    cfg: EngineConfig | None = None
    for dtype, note in dtypes:
        llm = LLM(**dataclasses.asdict(engine_config(args, dtype=dtype)))
        eng = llm.engine
        cfg = eng.config
        hf = None
        if not args.no_hf:
            from tokenq.engine.loader import load_checkpoint, resolve_model

            checkpoint = load_checkpoint(resolve_model(cfg.model), eng.dtype)
            hf = build_hf_model(checkpoint.config, checkpoint.weights, eng.dtype).to(eng.device)
            del checkpoint
        device_name = (
            torch.cuda.get_device_name(eng.device)
            if eng.device.type == "cuda"
            else f"{platform.processor() or platform.machine()} CPU, "
            f"{torch.get_num_threads()} threads"
        )
        print(
            f"# {dtype}{f' ({note})' if note else ''}: {device_name}; torch {torch.__version__}; "
            f"max_num_seqs={cfg.max_num_seqs} max_num_batched_tokens="
            f"{cfg.max_num_batched_tokens} block_size={cfg.block_size} "
            f"kv_blocks={eng.block_manager.num_blocks} attention={eng.backend.name}",
            flush=True,
        )
        for wl in workloads:
            warm_up(eng, wl.prompts)
            eng_s = run_engine(llm, wl)
            eng_tps = wl.useful_tokens / eng_s
            ours[(dtype, wl.name)] = eng_tps
            line = f"{dtype:<10}{wl.name:<22}{wl.useful_tokens:>8}{eng_tps:>14.1f}"
            if hf is not None:
                run_hf(hf, wl.warm_up(), args.hf_batch_size, eng.device)
                hf_tps = wl.useful_tokens / run_hf(hf, wl, args.hf_batch_size, eng.device)
                line += f"{hf_tps:>10.1f}{eng_tps / hf_tps:>7.2f}x"
            print(line, flush=True)
        del llm, eng, hf
    if args.vllm and cfg is not None:
        compare_vllm(args.vllm, cfg.model, args.vllm_dtype.split(","), workloads, cfg, ours)


def compare_vllm(
    python: str,
    model: str,
    dtypes: list[str],
    workloads: list[Workload],
    cfg: EngineConfig,
    ours: dict[tuple[str, str], float],
) -> None:
    """vLLM's rows after tokenq's, then tokenq over vLLM for every pair of dtypes."""
    with tempfile.TemporaryDirectory(prefix="tokenq-hf-") as folder:
        save_hf_folder(model, Path(folder))
        theirs = {}
        for dtype in (d.strip() for d in dtypes):
            version, rates = run_vllm(python, Path(folder), dtype, workloads, cfg)
            print(f"# vLLM {version} ({python}), {dtype}, same engine limits", flush=True)
            for name, rate in rates.items():
                theirs[(dtype, name)] = rate
                print(f"{'vllm ' + dtype:<16}{name:<22}{'':>8}{rate:>8.1f}", flush=True)
    print("# tokenq over vLLM, this run")
    for (our_dtype, name), rate in ours.items():
        for (their_dtype, their_name), their_rate in theirs.items():
            if their_name == name:
                pair = f"tokenq {our_dtype} / vLLM {their_dtype}"
                print(f"{pair:<38}{name:<22}{rate / their_rate:>7.2f}x")


if __name__ == "__main__":
    main()

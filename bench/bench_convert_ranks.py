"""``ckpt convert`` under torchrun at 1, 2 and 4 ranks on the same conversion: time and bytes read per rank.

Two conversions of one generated Llama-shaped model (bf16, HF shards of 32 MiB):

* NxD tag (TP 4) -> HF folder: units are HF shards; every full tensor is made of the 4 TP ranks' blocks;
* HF folder -> NxD tag with TP 4: units are the 4 target ranks; ``o_proj`` / ``down_proj`` are split by columns, so
  every rank needs a column block of each (read once by one rank and shipped over the process group).

Each run is ``python -m torch.distributed.run --standalone --nproc-per-node N -m ckpt convert ... --json`` (the
command a user runs); the wall time includes starting the ranks.  Rank 0's JSON report gives each rank's
``bytes_read`` / ``bytes_written`` / ``seconds``.  Also printed, from the plan alone: the bytes the ranks would read
if each read every stored tensor its units touch itself (no exchange).  The ratios are against the 1-rank run of
the same invocation, measured in the same run on the same machine (say its core count with the numbers).

Usage: ``python bench/bench_convert_ranks.py [--layers 8] [--workdir DIR]``; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2816,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}
SHARD = "32MiB"


def ckpt(*args: str, ranks: int = 1) -> tuple[float, dict[str, Any]]:
    """Run ``ckpt ARGS --json`` on ``ranks`` torchrun ranks; (wall seconds, rank 0's JSON)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        "ckpt",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PJRT_DEVICE="CPU")
    t = time.perf_counter()
    r = subprocess.run([*cmd, *args, "--json"], capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(args)}\n{r.stderr[-3000:]}")
    return wall, json.loads(r.stdout)


def generate(root: Path, layers: int) -> Path:
    """The model as our CUDA-layout checkpoint (random bf16), then as an HF folder."""
    import torch

    from ckpt.layouts import ModelDims
    from ckpt.saving.writer import StreamingWriter

    cfg = dict(CONFIG, num_hidden_layers=layers)
    (root / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    w = StreamingWriter(str(root / "gen"), flush_bytes=64 << 20)
    for name, shape in ModelDims.from_hf_config(cfg).hf_shapes().items():
        w.add(name, torch.rand(shape, generator=g).to(torch.bfloat16))
    w.commit(step=1, backend="cuda", trees={"extra": {"config": cfg}})
    ckpt(
        "convert",
        str(root / "gen"),
        str(root / "hf"),
        "--to",
        "cuda",
        "--format",
        "hf",
        "--max-shard-size",
        SHARD,
    )
    shutil.rmtree(root / "gen")
    return root / "config.json"


def without_exchange(src: str, argv: list[str], world: int) -> int:
    """Bytes the ranks would read if each read itself every stored tensor its units touch (from the plan)."""
    from ckpt.converters.convert import ConvertOptions, RunOptions, make_export, open_source, plan_conversion
    from ckpt.converters.engine import balance
    from ckpt.converters.engine.exchange import unit_pieces
    from ckpt.converters.engine.meter import needed_bytes

    o = ConvertOptions(**_options(argv))
    source = open_source(src, o)
    try:
        export = make_export(plan_conversion(source, o), o, RunOptions())
        return sum(
            needed_bytes(source, unit_pieces(export, share) or ()) for share in balance(export.weights, world)
        )
    finally:
        source.close()


def _options(argv: list[str]) -> dict[str, Any]:
    from ckpt.converters.options import load_config

    a = dict(zip(argv[::2], argv[1::2], strict=True))
    out: dict[str, Any] = {"to": a["--to"], "format": a["--format"], "config": load_config(a["--config"])}
    if "--tp" in a:
        out["layout"] = {"tp": int(a["--tp"])}
    if "--max-shard-size" in a:
        out["max_shard_bytes"] = 32 << 20
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--ranks", default="1,2,4")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-ranks-", dir=args.workdir))
    try:
        config = str(generate(root, args.layers))
        to_nxd = ["--to", "neuron", "--format", "nxd", "--tp", "4", "--config", config]
        ckpt("convert", str(root / "hf"), str(root / "tag"), *to_nxd)
        cases = [
            ("NxD tag (TP 4) -> HF", str(root / "tag"),
             ["--to", "cuda", "--format", "hf", "--max-shard-size", SHARD, "--config", config]),
            ("HF -> NxD tag (TP 4)", str(root / "hf"), to_nxd),
        ]  # fmt: skip
        size = sum(p.stat().st_size for p in (root / "hf").glob("*.safetensors"))
        print(
            f"model: {size / 2**20:.0f} MiB of bf16 tensors ({args.layers} layers), {os.cpu_count()} cores\n"
        )
        print("| conversion | ranks | wall s | x vs 1 rank | slowest rank s | read per rank MiB | read sum MiB "
              "| without exchange MiB |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for label, src, argv in cases:
            base = None
            for n in (int(x) for x in args.ranks.split(",")):
                dst = root / f"out-{n}"
                wall, doc = ckpt("convert", src, str(dst), *argv, ranks=n)
                shutil.rmtree(dst)
                ranks = doc["ranks"]
                base = base or wall
                per = " / ".join(f"{r['bytes_read'] / 2**20:.0f}" for r in ranks)
                total = sum(r["bytes_read"] for r in ranks) / 2**20
                alone = without_exchange(src, argv, n) / 2**20
                slow = max(r["seconds"] for r in ranks)
                print(f"| {label} | {n} | {wall:.1f} | {base / wall:.2f} | {slow:.1f} | {per} | {total:.0f} "
                      f"| {alone:.0f} |")  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

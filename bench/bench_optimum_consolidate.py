"""Peak memory of ``ckpt convert checkpoint-N OUT --to cuda --format hf`` against ``optimum-cli neuron consolidate``'s
code path, on the same optimum-neuron folder.

The folder: a generated Llama-shaped fp32 model (``bench/bench_memory.py``'s dimensions) (no optimizer: consolidate reads ``shards/model`` only), written by
``ckpt convert --to neuron --format optimum-neuron --tp 2 --no-xser`` (``shards/`` plain, as ``use_xser=False``
saves it), plus the ``mp_metadata_pp_rank_0.json`` that optimum-neuron's ``save_pretrained`` writes (parameters'
``tensor_model_parallel`` / ``partition_dim``, and the ``gate_up_proj`` ``FusedLinearsSpec``).

Baseline: optimum-neuron 0.4.0 cannot be imported here (it needs ``optimum``, transformers 4.x and NxD modules the
CPU stubs do not provide; ``pip install --no-deps optimum-neuron==0.4.0`` then ``import
optimum.neuron.models.training.checkpointing`` fails on ``transformers.utils.download_url``), so :func:`consolidate`
is its code path written out, step for step, from ``optimum/neuron/models/training/checkpointing.py`` v0.4.0:
``consolidate_model_parallel_checkpoints`` (lines 108-157: glob ``dp_rank_*.pt``, group by PP rank, load the
metadata), ``consolidate_tensor_parallel_checkpoints`` (lines 70-105: ``torch.load(weights_only=True)`` of every TP
rank file of the stage, then ``{name: [rank tensors]}``), ``transformations_utils.to_original_weights`` (v0.4.0
lines 1590-1642: the specs first, ``FusedLinearsSpec._to_original_weights`` = ``torch.split`` of each rank's fused
tensor and ``torch.cat`` over ranks; then ``torch.cat`` along ``partition_dim`` for TP tensors, rank 0's copy for
the rest) and ``consolidate_model_parallel_checkpoints_to_unified_checkpoint`` (lines 160-235:
``split_torch_state_dict_into_shards`` then ``save_file`` per shard, deleting each tensor from the dict once saved).

Both run in a child process per conversion, polled as ``bench/bench_memory.py`` polls (``tests/torture/memory.py``):
peak anon = peak ``RssAnon`` growth above the child right before the conversion; peak RSS the same for ``VmRSS``.
Usage: ``python bench/bench_optimum_consolidate.py [--layers 20] [--workdir DIR] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

from bench_memory import DIMS  # noqa: E402
from torture.memory import MIB, _status, config, generate_cuda  # noqa: E402

_CHILD = r"""
import gc, json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
mode, src, dst = sys.argv[2:5]
import torch
torch.set_num_threads(1)
from safetensors.torch import save_file
from huggingface_hub import split_torch_state_dict_into_shards
from ckpt.converters.convert import ConvertOptions, RunOptions, convert
from ckpt.converters import optimum_neuron, hf  # noqa: F401  (imported before the baseline)
from ckpt.converters.engine.allocator import pin_malloc
import bench_optimum_consolidate as b
if mode == "ckpt":
    pin_malloc()  # what `ckpt convert` does first
gc.collect()
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
if mode == "ckpt":
    convert(src, dst, ConvertOptions(to="cuda", format="hf"), RunOptions())
else:
    b.consolidate(Path(src), Path(dst), save_file, split_torch_state_dict_into_shards)
print("done", json.dumps({"wall": time.perf_counter() - t0}), flush=True)
"""


def consolidate(checkpoint: Path, out: Path, save_file, split) -> None:  # noqa: ANN001 - their callables
    """optimum-neuron 0.4.0's ``consolidate`` for a full-model folder (see the module docstring for the lines)."""
    import torch

    shards = checkpoint / "shards"
    files = list((shards / "model").glob("dp_rank_*.pt"))
    pp_size = max(int(p.stem[-2:]) for p in files) + 1
    state: dict[str, torch.Tensor] = {}
    for pp in range(pp_size):
        group = sorted(p for p in files if int(p.stem[-2:]) == pp)
        meta = json.loads((shards / f"mp_metadata_pp_rank_{pp}.json").read_text())
        dicts = [torch.load(p, weights_only=True) for p in group]
        sharded = {name: [d[name] for d in dicts] for name in dicts[0]}
        params, done, removed = meta["parameters"], {}, set()
        for spec in meta["model_weight_transformation_specs"]:
            for s in spec["specs"]:
                fused = f"{spec['module_fully_qualified_name']}.{s['fused_linear_name']}.weight"
                local = [
                    torch.split(t, [d // s["tp_size"] for d in s["original_dims"]], dim=s["fuse_axis"])
                    for t in sharded[fused]
                ]
                for i, lin in enumerate(s["linear_names"]):
                    done[f"{spec['module_fully_qualified_name']}.{lin}.weight"] = torch.cat(
                        [part[i] for part in local], dim=params[fused]["partition_dim"]
                    )
                removed.add(fused)
        for name, m in params.items():
            if name in done or name in removed or name not in sharded:
                continue
            done[name] = (
                torch.cat(sharded[name], dim=m["partition_dim"])
                if m["tensor_model_parallel"]
                else sharded[name][0]
            )
        state.update(done)
        del dicts, sharded, done
    split_ = split(state, filename_pattern="model{suffix}.safetensors")
    out.mkdir(parents=True, exist_ok=True)
    if split_.is_sharded:
        index = {"metadata": split_.metadata, "weight_map": split_.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for shard_file, names in split_.filename_to_tensors.items():
        shard = {}
        for n in names:
            shard[n] = state[n].contiguous()
            del state[n]
        save_file(shard, out / shard_file, metadata={"format": "pt"})


def write_metadata(checkpoint: Path) -> None:
    """``mp_metadata_pp_rank_P.json`` as optimum-neuron's ``create_parameter_metadata`` records it, from the tag's
    own partition entries (what its ``tensor_model_parallel`` / ``partition_dim`` attributes say)."""
    from ckpt.converters.optimum_neuron import OptimumNeuronSource

    src = OptimumNeuronSource(checkpoint)
    tp = src.flags.tp
    params, specs = {}, []
    cfg = src.config
    for name, desc in src.tensors.items():
        if desc.role != "parameter":
            continue
        part = desc.partition
        params[name] = {
            "tensor_model_parallel": part is not None,
            "partition_dim": int(part["dim"]) if part else -1,
        }
        if name.endswith("mlp.gate_up_proj.weight"):
            module = name[: -len(".gate_up_proj.weight")]
            specs.append({"module_fully_qualified_name": module, "specs": [{
                "fused_linear_name": "gate_up_proj", "linear_names": ["gate_proj", "up_proj"], "bias": False,
                "fuse_axis": 0, "original_dims": [cfg["intermediate_size"]] * 2, "tp_size": tp,
            }]})  # fmt: skip
    src.close()
    meta = {"parameters": params, "model_weight_transformation_specs": specs}
    (checkpoint / "shards" / "mp_metadata_pp_rank_0.json").write_text(json.dumps(meta, indent=4))


def measure(mode: str, src: Path, dst: Path) -> dict[str, float]:
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PJRT_DEVICE="CPU", PYTHONWARNINGS="ignore", PYTHONPATH=str(HERE)
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(ROOT / "tests"), mode, str(src), str(dst)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(x) for x in proc.stdout] + [lines.put(None)], daemon=True
    ).start()

    def wait_for(word: str, peak: dict[str, int] | None) -> str:
        while True:
            try:
                line = lines.get(timeout=0.001 if peak is not None else 1.0)
            except queue.Empty:
                line = ""
            if line is None:
                raise RuntimeError(f"child died: {proc.stderr.read()[-3000:]}")
            if line.startswith(word):
                return line
            if peak is not None:
                for k, v in _status(proc.pid).items():
                    peak[k] = max(peak.get(k, 0), v)

    wait_for("ready", None)
    before = _status(proc.pid)
    peak = dict(before)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    done = wait_for("done", peak)
    proc.stdin.close()
    proc.wait()
    return {
        "anon_mib": (peak["RssAnon"] - before["RssAnon"]) / MIB,
        "rss_mib": (peak["VmRSS"] - before["VmRSS"]) / MIB,
        "wall_s": json.loads(done.split(" ", 1)[1])["wall"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    from ckpt.converters.convert import ConvertOptions, convert

    work = Path(tempfile.mkdtemp(prefix="bench_on_", dir=a.workdir))
    try:
        cfg = config(a.layers, **DIMS)
        nbytes = generate_cuda(work / "cuda", cfg, optimizer=False)
        ck = work / "checkpoint-0"
        convert(
            str(work / "cuda"),
            str(ck),
            ConvertOptions.neuron(format="optimum-neuron", tp=2, xser=False, config=cfg),
        )
        shutil.rmtree(work / "cuda")
        write_metadata(ck)
        rows = {}
        for mode in ("optimum", "ckpt"):
            rows[mode] = measure(mode, ck, work / f"out_{mode}")
            shutil.rmtree(work / f"out_{mode}")
        result = {"model_mib": nbytes / MIB, "layers": a.layers, "tp": 2, **rows,
                  "anon_ratio": rows["optimum"]["anon_mib"] / max(rows["ckpt"]["anon_mib"], 1e-9)}  # fmt: skip
        print(json.dumps(result, indent=2))
        if a.json:
            a.json.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

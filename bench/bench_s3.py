"""S3 save/load through ckpt vs s3fs put/get of the same bytes, against a moto server on 127.0.0.1.

    .venv/bin/python bench/bench_s3.py [--mib 256] [--repeat 3] [--moto thread|process]

One process holds a --mib MiB state (fp32 tensors of LLM-like sizes). Measured in the same run, interleaved, medians
of --repeat:

* ckpt save (sync) and restore of that state to s3://, as shipped: a multipart upload from memory with 4 parts in
  flight, restores as coalesced ranged GETs, 4 in flight, checksums on a helper thread;
* the same with 1 part / 1 GET in flight (``max_concurrency=1``);
* "before": the previous S3 path, kept as a storage subclass here: each data file staged in a local temp file and
  uploaded with ``put_file``; loads one GET per stored chunk, one at a time;
* baselines: s3fs ``put_file`` of one local file holding the same bytes and ``cat_file`` of it back (both
  concurrent inside s3fs: 50 MiB parts/ranges, up to 10 in flight).

moto is a Python server: ``--moto thread`` (default) runs it in this process, as the tests do, so its CPU shares
this process's GIL; ``--moto process`` runs it in its own process. The CPU seconds each side used per operation
are reported (client: this process; server: moto's process, with ``--moto process``), to say who limits a figure.
Writes bench/results/s3.json (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from torture.s3 import moto_env, moto_server  # noqa: E402

from ckpt.storage import BACKENDS, Backend  # noqa: E402
from ckpt.storage.fsspec import FsspecStorage  # noqa: E402
from ckpt.storage.s3 import S3Storage  # noqa: E402


class BeforeS3(S3Storage):
    """The S3 path before multipart-from-memory: spool file + ``put_file``; one GET per chunk, one at a time."""

    create = FsspecStorage.create  # type: ignore[assignment]
    reads_in_flight = 1
    read_piece = 8 << 20  # = the chunk size: never coalesces two chunks


@contextlib.contextmanager
def moto_process(bucket: str) -> Iterator[tuple[str, int]]:
    """moto's ThreadedMotoServer in a child process on 127.0.0.1; yields (endpoint, pid)."""
    moto_env()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import logging, time\n"
        "from moto.server import ThreadedMotoServer\n"
        "logging.getLogger('werkzeug').setLevel(logging.ERROR)\n"
        f"ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False).start()\n"
        "while True: time.sleep(3600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1)
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                time.sleep(0.1)
        import boto3

        boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield url, proc.pid
    finally:
        proc.kill()
        proc.wait()


def cpu_of(pid: int | None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (0 when None)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--moto", choices=("thread", "process"), default="thread")
    p.add_argument("--out", default=os.path.join(HERE, "results", "s3.json"))
    args = p.parse_args()
    import fsspec
    import torch

    import ckpt

    g = torch.Generator().manual_seed(0)
    rows = max(1, args.mib * (1 << 20) // (4 * 4096 * 8))
    state = {f"layers.{i}.weight": torch.randn(rows, 4096, generator=g) for i in range(8)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    res: dict[str, list[float]] = {}
    cpu: dict[str, list[tuple[float, float]]] = {}
    server = moto_process("ckpt-bench") if args.moto == "process" else moto_server("ckpt-bench")
    with server as srv, tempfile.TemporaryDirectory() as d:
        endpoint, pid = srv if isinstance(srv, tuple) else (srv, None)
        options = {"client_kwargs": {"endpoint_url": endpoint}}
        one = {**options, "max_concurrency": 1}
        fs = fsspec.filesystem("s3", **options)
        raw = os.path.join(d, "raw.bin")
        with open(raw, "wb") as f:
            for t in state.values():
                f.write(t.view(-1).view(torch.uint8).numpy().tobytes())

        def timed(key: str, fn) -> None:  # noqa: ANN001
            c0, s0, t0 = time.process_time(), cpu_of(pid), time.perf_counter()
            fn()
            res.setdefault(key, []).append(time.perf_counter() - t0)
            cpu.setdefault(key, []).append((time.process_time() - c0, cpu_of(pid) - s0))

        variants = [
            ("ckpt", "ckpt.storage.s3:S3Storage", options),
            ("ckpt 1 in flight", "ckpt.storage.s3:S3Storage", one),
            ("before", "__main__:BeforeS3", options),
        ]
        for rep in range(args.repeat):
            for name, target, opts in variants:
                BACKENDS["s3"] = Backend(target, "s3fs")
                url = f"s3://ckpt-bench/{name.replace(' ', '-')}/step_{rep:08d}"
                timed(
                    f"{name} save",
                    functools.partial(ckpt.save, url, step=rep, model=state, rng=False, storage_options=opts),
                )
                back = {k: torch.empty_like(v) for k, v in state.items()}
                timed(
                    f"{name} load",
                    functools.partial(ckpt.restore, url, model=back, rng=False, storage_options=opts),
                )
                assert all(torch.equal(back[k], v) for k, v in state.items())
            BACKENDS["s3"] = Backend("ckpt.storage.s3:S3Storage", "s3fs")
            key = f"ckpt-bench/raw/{rep}.bin"
            timed("s3fs put_file", functools.partial(fs.put_file, raw, key))
            got: list[bytes] = []
            timed("s3fs get", functools.partial(lambda k, out: out.append(fs.cat_file(k)), key, got))
            assert len(got[0]) == nbytes
            got.clear()
    med = {k: statistics.median(v) for k, v in res.items()}
    mib = nbytes / (1 << 20)
    put, get = med["s3fs put_file"], med["s3fs get"]
    out = {
        "args": vars(args),
        "bytes": nbytes,
        "seconds": med,
        "all_seconds": res,
        "cpu_seconds_client_server": {
            k: [round(sum(x[i] for x in v) / len(v), 3) for i in (0, 1)] for k, v in cpu.items()
        },
        "MiB_per_s": {k: mib / v for k, v in med.items()},
        "time_vs_s3fs": {
            k: med[k] / (put if k.endswith("save") or k.endswith("put_file") else get) for k in med
        },
        "save_vs_put": put / med["ckpt save"],
        "load_vs_get": get / med["ckpt load"],
    }
    print(json.dumps({k: v for k, v in out.items() if k != "all_seconds"}, indent=2))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

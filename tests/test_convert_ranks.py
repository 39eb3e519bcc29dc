"""torchrun conversions on 4 gloo ranks: every source x target pair of the fixture, output equal to the one-process
run, read traffic bounded, one report.

* Sources: the NxD training tag (TP 2, ZeRO-1 over DP 2, Adam state) and what it converts to: our format in the CUDA
  and in the Neuron layout, an HF folder (shards of 100 kB), a DCP folder.  Targets: our format (CUDA; Neuron TP 4),
  HF, DCP, an NxD tag with TP 4 (4 units: o_proj / down_proj split by columns, each needed by every rank).
* Output: HF and NxD byte for byte the serial files; our format and DCP the same tensors and state when read back
  (their data files are per writer, so their names and split differ by design).
* Reads: the sum over ranks of ``bytes_read`` is at most 1.1x the stored bytes the output needs, computed from the
  plan (no read): the union of the byte ranges its pieces touch.  The one-process run reads at least that (for an HF
  source exactly the tensor bytes of its shards, checked against the files); without the exchange of shared
  tensors the 4 ranks read more (tested on the plan, and the bound fails on 5 pairs when it is switched off).
* Report: rank 0's result lists the 4 ranks; its progress adds up to the planned bytes of all ranks; through the
  CLI, rank 0 prints one JSON document and the other ranks print nothing; when one rank's share reads a damaged
  shard, that rank prints its own error, rank 0 the outcome, the others nothing (all exit non-zero).
* S3: SRC (our format) and DST on a real moto server, 4 ranks: the local one-process bytes, reads bounded.

The 4-rank group is spawned once for all pairs (tiny model: the whole file runs in about a minute on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ckpt.converters.convert import ConvertOptions, RunOptions, convert, load_config

from ckpt import open_checkpoint
from ckpt.format import treecodec
from tests.conftest import run_ranks
from tests.test_convert_parallel import assert_equal_tree, break_last_shard, dcp_state, files

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "nxd" / "llama_gqa_h64"
TAG = FIX / "nxd_train_tp2_dp2_zero1_plain" / "step_3"
CONFIG = load_config(str(FIX / "config.json"))
SHARD = 100_000
WORLD = 4
TP4 = dict(tp=4, kv_size_multiplier=2, qkv_linear=True)

TARGETS: dict[str, dict[str, Any]] = {
    "ckpt": dict(to="cuda"),
    "ckpt-neuron": dict(to="neuron", layout=TP4),
    "hf": dict(to="cuda", format="hf", max_shard_bytes=SHARD),
    "dcp": dict(to="cuda", format="dcp"),
    "nxd": dict(to="neuron", format="nxd", layout=TP4),
}
#: how each source is made from the tag (None: the tag itself)
SOURCES: dict[str, dict[str, Any] | None] = {
    "nxd": None,
    "ckpt": dict(to="cuda"),
    "ckpt-neuron": dict(to="neuron", layout=dict(tp=2, dp=2, qkv_linear=True)),
    "hf": dict(to="cuda", format="hf", max_shard_bytes=SHARD),
    "dcp": dict(to="cuda", format="dcp"),
}
PAIRS = [(s, t) for s in SOURCES for t in TARGETS]


def opts(target: str) -> ConvertOptions:
    return ConvertOptions(config=CONFIG, **TARGETS[target])


def _quiet_convert(src: str, dst: str, o: ConvertOptions, **kw: Any) -> Any:
    """``convert`` without its warnings (what the HF folder leaves out, said on every conversion to HF)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert(src, dst, o, **kw)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ranks")
    out = {}
    for name, how in SOURCES.items():
        if how is None:
            out[name] = TAG
            continue
        out[name] = root / f"src_{name}"
        _quiet_convert(str(TAG), str(out[name]), ConvertOptions(config=CONFIG, **how))
    return out


@pytest.fixture(scope="module")
def serial(
    sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], tuple[Path, dict[str, Any]]]:
    """Every pair converted in one process: (its output, its own report line)."""
    root = tmp_path_factory.mktemp("serial")
    out = {}
    for s, t in PAIRS:
        dst = root / f"{s}_{t}"
        r = _quiet_convert(str(sources[s]), str(dst), opts(t))
        assert len(r.ranks) == 1 and r.ranks[0]["bytes_read"] > 0
        out[(s, t)] = (dst, r.ranks[0])
    return out


def _ranks_convert_all(rank: int, world: int, srcs: dict[str, str], root: str) -> dict[str, Any]:
    results = {}
    for s, t in PAIRS:
        seen = {"progress": 0, "total": None}

        def progress(n: int, seen: dict[str, Any] = seen) -> None:
            seen["progress"] += n

        def on_plan(n: int, seen: dict[str, Any] = seen) -> None:
            seen["total"] = n

        r = _quiet_convert(srcs[s], str(Path(root) / f"{s}_{t}"), opts(t), progress=progress, on_plan=on_plan)
        results[f"{s}|{t}"] = {"ranks": list(r.ranks), **seen}
    return results


@pytest.fixture(scope="module")
def ranked(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("ranked")
    got = run_ranks(
        _ranks_convert_all, WORLD, {k: str(v) for k, v in sources.items()}, str(root), timeout=600
    )
    return root, got


def needed(src: str, target: str, run: RunOptions | None = None) -> int:
    """The stored source bytes the output is made of, from the plan alone (no read): the union, per stored tensor
    (or, for our format, per data file), of the byte ranges every piece of every output unit touches."""
    from ckpt.converters.convert import make_export, open_source, plan_conversion
    from ckpt.converters.engine.exchange import unit_pieces
    from ckpt.converters.engine.meter import needed_bytes

    o = opts(target)
    source = open_source(src, o, run)
    try:
        export = make_export(plan_conversion(source, o), o, RunOptions())
        return needed_bytes(source, unit_pieces(export, range(len(export.weights))) or ())
    finally:
        source.close()


def ckpt_state(root: Path) -> dict[str, Any]:
    """Our checkpoint as read back: every tensor, and the state the manifest keeps."""
    r = open_checkpoint(str(root))
    m = r.manifest
    return {
        "tensors": {n: r.read(n) for n in sorted(r.names())},
        "descs": {n: (e.role, e.shape, e.dtype, e.partition) for n, e in sorted(m.tensors.items())},
        "layout": (m.backend, m.layout),
        "step": m.step,
        "optimizer": treecodec.decode(m.optimizer) if m.optimizer is not None else None,
        "scheduler": m.scheduler,
        "extra": m.extra,
    }


@pytest.mark.parametrize(("src", "target"), PAIRS)
def test_four_ranks_equal_one_process_and_read_each_byte_once(
    src: str, target: str, sources: dict[str, Path], serial: dict, ranked: tuple[Path, list[dict]]
) -> None:
    root, got = ranked
    dst = root / f"{src}_{target}"
    want, one = serial[(src, target)]
    if target in ("hf", "nxd"):
        assert files(dst) == files(want)
    elif target == "dcp":
        assert_equal_tree(dcp_state(dst), dcp_state(want))
    else:
        assert_equal_tree(ckpt_state(dst), ckpt_state(want))
    key = f"{src}|{target}"
    report = got[0][key]["ranks"]
    assert [r["rank"] for r in report] == list(range(WORLD))
    assert all(g[key]["ranks"] == [] for g in got[1:])  # only rank 0 reports
    read = sum(r["bytes_read"] for r in report)
    need = needed(str(sources[src]), target)
    assert one["bytes_read"] >= need > 0  # the one-process run reads at least that (ours: some bytes twice)
    assert read <= 1.1 * need, (read, need, one["bytes_read"], report)
    written = sum(r["bytes_written"] for r in report)
    assert written >= one["bytes_written"] > 0
    # rank 0's progress covers every rank's writing
    assert got[0][key]["progress"] == got[0][key]["total"], got[0][key]
    if target in ("nxd", "ckpt-neuron"):
        assert sum(1 for r in report if r["bytes_read"] > 0) >= 2  # the work was split


def test_one_process_reads_every_stored_byte_once(sources: dict[str, Path], serial: dict) -> None:
    """The denominator is honest: an HF source's one-process read, into a TP 4 tag (column blocks of o_proj
    included), is exactly the tensor bytes of its shards (header bytes excluded), each byte once."""
    from ckpt.converters.hf import read_header

    total = 0
    for f in sources["hf"].glob("model-*.safetensors"):
        for name, entry in read_header(f).items():
            if name != "__metadata__":
                total += entry["data_offsets"][1] - entry["data_offsets"][0]
    assert serial[("hf", "nxd")][1]["bytes_read"] == total
    assert serial[("hf", "hf")][1]["bytes_read"] == total


def test_without_the_exchange_the_ranks_read_more(sources: dict[str, Path]) -> None:
    """The plan the ranks exchange by: a TP 4 target from an HF source shares every column-split tensor and
    norm, and reading them on every rank instead would pass the 1.1x bound."""
    from ckpt.converters.convert import make_export, open_source, plan_conversion
    from ckpt.converters.engine import balance
    from ckpt.converters.engine.exchange import plan_exchange, unit_pieces
    from ckpt.converters.engine.meter import needed_bytes

    o = opts("nxd")
    source = open_source(str(sources["hf"]), o)
    try:
        export = make_export(plan_conversion(source, o), o, RunOptions())
        needs = [unit_pieces(export, s) for s in balance(export.weights, WORLD)]
        shared = plan_exchange(source, needs)
        names = {t.tensor.name for t in shared}
        assert {n for n in source.tensors if n.endswith(("o_proj.weight", "down_proj.weight"))} <= names
        assert all(len(t.wants) == WORLD for t in shared if t.tensor.name.endswith("o_proj.weight"))

        every_rank = sum(needed_bytes(source, n) for n in needs)
        once = needed_bytes(source, set().union(*needs))
        assert every_rank > 1.1 * once  # the bound the exchange meets would fail without it
    finally:
        source.close()


def _cli_rank(rank: int, world: int, src: str, dst: str) -> tuple[int, str, str]:
    from ckpt.cli.main import cli
    from click.testing import CliRunner

    args = ["convert", src, dst, "--to", "neuron", "--format", "nxd", "--tp", "4", "--kv-size-multiplier", "2",
            "--qkv-linear", "--json"]  # fmt: skip
    r = CliRunner().invoke(cli, args)
    return r.exit_code, r.stdout, r.stderr


def test_cli_one_report_from_rank_0(sources: dict[str, Path], tmp_path: Path) -> None:
    got = run_ranks(_cli_rank, WORLD, str(sources["hf"]), str(tmp_path / "out"))
    assert [g[0] for g in got] == [0] * WORLD, got
    assert all(g[1] == "" and g[2] == "" for g in got[1:]), got  # the other ranks print nothing
    doc = json.loads(got[0][1])
    assert [r["rank"] for r in doc["ranks"]] == list(range(WORLD))
    assert set(doc["ranks"][0]) == {"rank", "bytes_read", "bytes_written", "seconds", "bytes_received"}
    assert sum(r["bytes_received"] for r in doc["ranks"]) > 0  # column blocks of o_proj / down_proj, norms
    assert (tmp_path / "out" / "done").exists() or (tmp_path / "out").is_dir()


def _ranks_s3(rank: int, world: int, src: str, dst: str, options: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for target in ("nxd", "hf"):
        r = _quiet_convert(src, f"{dst}/{target}", opts(target), run=RunOptions(storage_options=options))
        out[target] = list(r.ranks)
    return out


@pytest.mark.s3
def test_four_ranks_from_s3_to_s3(sources: dict[str, Path], serial: dict, s3: Any, tmp_path: Path) -> None:
    """SRC (our format) and DST on S3 (a real moto server): each rank uploads its own files, rank 0 commits; the
    objects are the one-process local output, and the ranks' reads (counted at the storage layer: ranged GETs)
    stay within 1.1x of what the output needs."""
    src = f"{s3.url}/src"
    _quiet_convert(
        str(sources["ckpt"]),
        src,
        ConvertOptions(to="cuda"),
        run=RunOptions(storage_options=s3.storage_options),
    )
    got = run_ranks(_ranks_s3, WORLD, src, f"{s3.url}/out", s3.storage_options)
    fs = s3.fs()
    fs.invalidate_cache()
    for target in ("nxd", "hf"):
        local = tmp_path / target
        fs.get(f"{s3.url}/out/{target}".removeprefix("s3://") + "/", str(local), recursive=True)
        assert files(local) == files(serial[("ckpt", target)][0]), target
        report = got[0][target]
        assert [r["rank"] for r in report] == list(range(WORLD)) and all(g[target] == [] for g in got[1:])
        need = needed(src, target, RunOptions(storage_options=s3.storage_options))
        read = sum(r["bytes_read"] for r in report)
        assert 0 < read <= 1.1 * need, (target, read, need, report)
    assert s3.boto3_client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads", []) == []


def _cli_rank_hf(rank: int, world: int, src: str, dst: str) -> tuple[int, str, str]:
    from ckpt.cli.main import cli
    from click.testing import CliRunner

    r = CliRunner().invoke(
        cli, ["convert", src, dst, "--to", "cuda", "--format", "hf", "--max-shard-size", str(SHARD)]
    )
    return r.exit_code, r.stdout, r.stderr


def test_cli_a_failed_rank_says_its_own_error_rank_0_says_the_outcome(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    """One rank's share reads a damaged shard: that rank prints its own error, rank 0 the outcome, the others
    nothing; every rank exits non-zero and nothing is committed."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(sources["hf"], broken)
    break_last_shard(broken)
    got = run_ranks(_cli_rank_hf, WORLD, str(broken), str(tmp_path / "out"))
    assert all(code != 0 for code, _, _ in got), got
    assert "conversion failed, nothing committed: rank" in got[0][2]
    failed = [r for r in range(WORLD) if f"rank {r}:" in got[0][2]]
    assert failed and len(failed) < WORLD, got[0][2]
    for r in range(1, WORLD):
        assert got[r][1] == "", got[r]
        assert (got[r][2] != "") == (r in failed), (r, got[r])
    assert not (tmp_path / "out").exists()

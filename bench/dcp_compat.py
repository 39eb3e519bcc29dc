"""Does ``ckpt convert --format dcp`` output load with the DCP of every torch the project supports?

Two halves, run by ``.ci/dcp_compat.sh`` (which makes one throwaway venv per torch minor version):

    .venv/bin/python bench/dcp_compat.py make DIR     # project venv: a checkpoint, its DCP exports, the truth
    /tmp/venv-2.6/bin/python bench/dcp_compat.py check DIR   # any venv holding torch (+ safetensors) only

``make`` trains a small mixed-dtype model (float32 + bfloat16 parameters, an int64 buffer) two AdamW steps, saves
it with ``ckpt.save``, converts it with the real CLI to DCP twice (serial: one ``__0_0.distcp``; ``--workers 2``:
one file per worker, DCP's multi-rank layout) and dumps the truth: ``get_state_dict``'s model and optimizer
tensors to ``truth.safetensors`` and the param groups to ``truth.json``.

``check`` imports nothing from this project (the target venv does not have it): it builds a state dict of the
truth's shapes and dtypes filled with zeros (non-tensor leaves ``None``), calls that torch's
``torch.distributed.checkpoint.load`` without a process group, and requires every tensor bit-equal to the truth,
every param-group value equal, and the checkpoint to hold no key the state dict did not ask for.  Exit status 1 on
any difference (the first differences are printed).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

EXPORTS = {"serial": [], "workers2": ["--workers", "2"]}


def make(out: Path) -> None:
    """The checkpoint, its DCP exports (via the ``ckpt`` CLI) and the truth they must load to."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ckpt

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(50, 24)
            self.proj = torch.nn.Linear(24, 40)
            self.head = torch.nn.Linear(40, 50, bias=False).to(torch.bfloat16)
            self.norm = torch.nn.LayerNorm(24)
            self.register_buffer("positions", torch.arange(7, dtype=torch.int64))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.proj(self.norm(self.embed(ids))))
            return self.head(h.to(torch.bfloat16)).float()

    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
    for step in range(2):
        ids = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.cross_entropy(model(ids).reshape(-1, 50), ids.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    ckpt.save(str(out / "src"), step=2, model=model, optimizer=opt)

    msd, osd = get_state_dict(model, opt)
    flat = {f"model/{k}": v.detach().contiguous() for k, v in msd.items()}
    for param, per in osd["state"].items():
        for key, value in per.items():
            flat[f"optim/{param}/{key}"] = value.detach().contiguous()
    save_file(flat, str(out / "truth.safetensors"))
    (out / "truth.json").write_text(json.dumps({"param_groups": osd["param_groups"]}, indent=1))

    for name, args in EXPORTS.items():
        subprocess.run(
            [sys.executable, "-m", "ckpt", "convert", str(out / "src"), str(out / name), "--to", "cuda"]
            + ["--format", "dcp", *args],
            check=True,
        )
    print(f"made {out}: {len(flat)} tensors; exports {', '.join(EXPORTS)}")


def _blank(value: Any) -> Any:
    """``value``'s structure with every scalar leaf ``None`` (the same DCP flattening keys, nothing to compare)."""
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_blank(v) for v in value]
    return None


def _norm(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value


def check_one(
    folder: Path, truth: dict[str, Any], groups: list[dict[str, Any]]
) -> tuple[list[str], dict[str, Any]]:
    """Differences between what this torch's ``dcp.load`` gives for ``folder`` and the truth."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in truth.items():
        kind, rest = name.split("/", 1)
        if kind == "model":
            model[rest] = torch.zeros_like(t)
        else:
            param, key = rest.rsplit("/", 1)
            state.setdefault(param, {})[key] = torch.zeros_like(t)
    sd: dict[str, Any] = {"model": model, "optim": {"state": state, "param_groups": _blank(groups)}}
    flat, _ = flatten_state_dict(sd)
    stored = set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    problems = []
    if stored != set(flat):
        problems.append(
            f"keys: only stored {sorted(stored - set(flat))[:5]}, only asked {sorted(set(flat) - stored)[:5]}"
        )
    dcp.load(sd, checkpoint_id=str(folder))
    for name, want in truth.items():
        kind, rest = name.split("/", 1)
        if kind == "model":
            got = sd["model"][rest]
        else:
            param, key = rest.rsplit("/", 1)
            got = sd["optim"]["state"][param][key]
        if got.dtype != want.dtype or got.shape != want.shape:
            problems.append(f"{name}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}")
        elif not torch.equal(got, want):
            n = int((got != want).sum())
            problems.append(f"{name}: {n} of {want.numel()} values differ")
    got_groups = _norm(sd["optim"]["param_groups"])
    if got_groups != _norm(groups):
        problems.append(f"param_groups: got {got_groups}, want {groups}")
    return problems, sd


def readback(data: Path) -> int:
    """Project venv: each ``written-<version>`` folder (``dcp.save`` of an older torch) imports with ``ckpt
    convert`` (``.metadata`` through the allow-list) to exactly the truth."""
    import torch
    from safetensors.torch import load_file

    from ckpt import open_checkpoint
    from ckpt.format import treecodec

    truth = load_file(str(data / "truth.safetensors"))
    groups = json.loads((data / "truth.json").read_text())["param_groups"]
    failed = False
    for folder in sorted(data.glob("written-*")):
        out = data / f"imported-{folder.name}"
        subprocess.run(
            [sys.executable, "-m", "ckpt", "convert", str(folder), str(out), "--to", "cuda", "--step", "2"],
            check=True,
        )
        r = open_checkpoint(str(out))
        problems = []
        for name, want in truth.items():
            kind, rest = name.split("/", 1)
            if kind == "optim" and want.dim() == 0:
                param, key = rest.rsplit("/", 1)
                got = treecodec.decode(r.manifest.optimizer["state"][param][key])
            else:
                got = r.read(rest if kind == "model" else name)
            if got.dtype != want.dtype or not torch.equal(got, want):
                problems.append(f"{name}: differs")
        got_groups = [
            {k: v for k, v in g.items() if k != "params"} for g in r.manifest.optimizer["param_groups"]
        ]
        want_groups = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        if _norm([{k: treecodec.decode(v) for k, v in g.items()} for g in got_groups]) != _norm(want_groups):
            problems.append(f"param_groups: got {got_groups}")
        print(f"import of {folder.name} (dcp.save): {'OK' if not problems else 'FAIL'}, {len(truth)} tensors")
        for p in problems[:10]:
            print(f"  {p}")
        failed |= bool(problems)
    return 1 if failed else 0


def check(data: Path) -> int:
    """Load every export with this torch; then ``dcp.save`` what was loaded to ``written-<torch version>`` (the
    other direction: ``readback`` imports it with the project)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    truth = load_file(str(data / "truth.safetensors"))
    groups = json.loads((data / "truth.json").read_text())["param_groups"]
    failed = False
    for name in EXPORTS:
        problems, sd = check_one(data / name, truth, groups)
        if name == "serial" and not problems:
            dcp.save(sd, checkpoint_id=str(data / f"written-{torch.__version__.split('+')[0]}"))
        files = sorted(p.name for p in (data / name).glob("*.distcp"))
        status = "OK" if not problems else "FAIL"
        print(f"torch {torch.__version__}: {name} ({', '.join(files)}): {status}, {len(truth)} tensors")
        for p in problems[:10]:
            print(f"  {p}")
        failed |= bool(problems)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("make", "check", "readback"):
        print("usage: dcp_compat.py make|check|readback DIR", file=sys.stderr)
        return 2
    if argv[0] == "make":
        make(Path(argv[1]))
        return 0
    return (check if argv[0] == "check" else readback)(Path(argv[1]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Run by tests/test_lazy_staging.py in a fresh process (PJRT_DEVICE=CPU): what in-place edits do to held XLA
tensors, and an async lazy save of XLA state mutated right after ``save()`` returns.  Prints one JSON line."""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import torch_xla.core.xla_model as xm

from ckpt import SaveOptions
from ckpt.format.reader import CheckpointReader
from ckpt.saving.checkpointer import Checkpointer
from ckpt.state.training import optim_name


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def main(path: str) -> None:
    dev = xm.xla_device()
    p = torch.zeros(4, device=dev)
    xm.mark_step()
    alias, view = p.detach(), p[:2]  # what a lazy stager would hold instead of a copy
    before = p.cpu().tolist()
    p.add_(1.0)
    xm.mark_step()
    res: dict = {
        "p_before_edit": before,
        "p_after_edit": p.cpu().tolist(),
        "alias_after_edit": alias.cpu().tolist(),
        "view_after_edit": view.cpu().tolist(),
    }

    torch.manual_seed(0)
    m = torch.nn.Linear(6, 3).to(dev)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)

    def step() -> None:
        opt.zero_grad()
        m(torch.ones(2, 6, device=dev)).pow(2).mean().backward()
        opt.step()
        xm.mark_step()

    step()
    want = {n: sha(t) for n, t in m.state_dict().items()}
    names = {id(q): n for n, q in m.named_parameters()}
    for q, s in opt.state.items():
        for k, v in s.items():
            if v.dim() > 0:
                want[optim_name(names[id(q)], k)] = sha(v)
    ck = Checkpointer(async_save=True)
    ck.save(path, step=1, model=m, optimizer=opt, options=SaveOptions(rng=False))
    info = ck.last_staging
    step()  # right away, no staged(): XLA tensors were copied before save() returned
    with torch.no_grad():
        for t in m.state_dict().values():
            t.mul_(-2.0)
        for s in opt.state.values():
            for v in s.values():
                if v.dim() > 0:
                    v.add_(5.0)
    xm.mark_step()
    ck.close()
    r = CheckpointReader(path)
    res.update(
        lazy_bytes=info.lazy_bytes,
        reason=info.reason,
        want=want,
        saved={n: sha(r.read(n)) for n in r.names()},
    )
    print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])

"""Property (issue 9): random small models and NxD layouts with one extra tensor the rule set does not know never give
exit 0 with output that differs from the truth.  The extra tensor is TP-sharded (each rank holds its own rows),
replicated with equal copies, or replicated with one diverged copy; the user declares it replicated or not.  Both
directions run through the real converter: an NxD tag (rank files as NxD writes them) -> CUDA, and CUDA -> Neuron ->
CUDA.  Each outcome is either a refusal (``CkptError``, nothing at the destination) or bit-exact output."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from ckpt.converters.convert import ConvertOptions, convert
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ckpt import open_checkpoint
from ckpt.errors import CkptError, LayoutError
from ckpt.layouts import LayoutSpec, bit_equal, full_state_to_nxd
from ckpt.saving.writer import StreamingWriter
from tests.test_convert_roundtrip import cases, full_names


@st.composite
def injections(draw):  # noqa: ANN201
    return {
        "name": f"model.extra{draw(st.integers(0, 9))}.{draw(st.sampled_from(['weight', 'bias', 'scale']))}",
        "kind": draw(st.sampled_from(["sharded", "equal", "diverged"])),
        "declare": draw(st.booleans()),
        "rows": draw(st.sampled_from([1, 2, 3])),
        "cols": draw(st.sampled_from([1, 4])),
        "direction": draw(st.sampled_from(["from_nxd", "to_neuron"])),
        "seed": draw(st.integers(0, 1000)),
    }


def _state(cfg: dict, dtype: torch.dtype, bias: bool, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in full_names(cfg, bias).items()}


def _outcome(fn) -> bool:  # noqa: ANN001
    """True when ``fn`` succeeded, False when it refused with a CkptError (anything else fails the test)."""
    try:
        fn()
    except CkptError:
        return False
    return True


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), inj=injections())
def test_unknown_tensor_is_refused_or_exact(case, inj) -> None:  # noqa: ANN001
    cfg, flags, dtype, bias, seed = case
    try:
        spec = LayoutSpec.from_hf_config(cfg, **flags)
    except LayoutError:
        assume(False)
        return
    model = _state(cfg, dtype, bias, seed)
    g = torch.Generator().manual_seed(inj["seed"])
    name, tp, pp = inj["name"], spec.tp, spec.pp
    shard = [torch.randn(inj["rows"], inj["cols"], generator=g).to(dtype) for _ in range(tp)]
    declared = ["model.extra*"] if inj["declare"] else []
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        if inj["direction"] == "from_nxd":
            # what each rank holds, and the truth (None: no truth, the copies disagree)
            if inj["kind"] == "sharded":
                held = {(t, p): shard[t] for t in range(tp) for p in range(pp)}
                truth = torch.cat(shard) if tp > 1 else shard[0]
            else:
                held = {(t, p): shard[0] for t in range(tp) for p in range(pp)}
                truth = shard[0]
                if inj["kind"] == "diverged":
                    odd = (inj["seed"] % tp, inj["seed"] % pp)
                    held[odd] = shard[0] + 1
                    truth = None if tp * pp > 1 else shard[0] + 1
            tag = root / "tag"
            (tag / "model").mkdir(parents=True)
            for (t, p), sd in full_state_to_nxd(model, spec).items():
                sd = {**sd, name: held[(t, p)].clone()}
                torch.save(sd, tag / "model" / f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt")
            opts = ConvertOptions(to="cuda", config=cfg, replicated=declared)
            ok = _outcome(lambda: convert(str(tag), str(root / "out"), opts))
        else:
            truth = shard[0]
            w = StreamingWriter(str(root / "cuda"))
            for n, t in {**model, name: truth}.items():
                w.add(n, t)
            w.commit(step=1, backend="cuda", trees={"extra": {"config": cfg}})
            opts = ConvertOptions.neuron(**flags, replicated=declared)

            def both() -> None:
                convert(str(root / "cuda"), str(root / "neuron"), opts)
                convert(str(root / "neuron"), str(root / "out"), ConvertOptions(to="cuda"))

            ok = _outcome(both)
        if not ok:
            assert not (root / "out" / "manifest.json").exists()
            kind = inj["kind"]
            fine = inj["direction"] == "to_neuron" or kind == "equal" or (kind == "sharded" and tp == 1)
            assert not (inj["declare"] and (fine or (kind == "diverged" and tp * pp == 1))), (
                "a good input refused"
            )
            return
        assert truth is not None, "exit 0 although the copies of a replicated tensor disagree"
        out = open_checkpoint(str(root / "out"))
        assert sorted(out.names("parameter")) == sorted([*model, name])
        assert bit_equal(out.read(name), truth), "exit 0 with a wrong extra tensor"
        assert all(bit_equal(out.read(n), t) for n, t in model.items())

"""Save-time facts (``ckpt.state.save_facts``): the RNG state a checkpoint captured and a sampled fingerprint of the
live weights, logged in the ledger's save event, the RNG after the restore in its restore event, and what
verify-resume decides from them where no step overlaps: a restore that did not apply the RNG, a checkpoint N that
holds another step's weights.  Unit tests of the fields and checks, then real runs of the generator
(``ckpt.resume.truth``) with the defects planted as the benchmark plants them."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckpt import CheckpointManager
from ckpt.resume.checks import Cause, Status
from ckpt.resume.ledger import LedgerWriter, checkpoints_dir
from ckpt.resume.manifest_facts import ManifestFacts
from ckpt.resume.model import Restore, Save
from ckpt.resume.report import render_text
from ckpt.resume.sources import load_run, read_jsonl
from ckpt.resume.truth import TruthConfig, branch, trunk
from ckpt.resume.verify import verify_run
from ckpt.state.save_facts import (
    SAMPLE,
    compare_samples,
    manifest_sample,
    positions,
    rng_digests,
    safetensors_sample,
    tensor_sample,
    weights_sample,
)

pytestmark = pytest.mark.timeout(300)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Linear(64, 3))


# ------------------------------------------------------------------------------------------------ the facts
def test_rng_digests_name_each_stream_and_follow_its_state() -> None:
    before = rng_digests()
    assert {"python", "numpy", "torch"} <= set(before)
    state = torch.get_rng_state()
    torch.rand(3)
    moved = rng_digests()
    assert moved["torch"] != before["torch"] and moved["python"] == before["python"]
    torch.set_rng_state(state)
    assert rng_digests() == before
    random.random()
    assert rng_digests()["python"] != before["python"]


def test_positions_are_fixed_and_cover_small_tensors_whole() -> None:
    assert positions(5) == [0, 1, 2, 3, 4]
    big = positions(10_000)
    assert len(big) == SAMPLE and big == sorted(set(big)) and big[-1] < 10_000


def test_weight_sample_equals_the_checkpoints_and_sees_a_changed_element(tmp_path: Path) -> None:
    model = _model()
    live = weights_sample(model)
    assert live is not None and set(live) == set(model.state_dict())
    with CheckpointManager(str(tmp_path / "ck"), async_save=False) as mgr:
        mgr.save(1, model=model)
    stored = manifest_sample(str(tmp_path / "ck" / "step_00000001"))
    assert stored is not None and compare_samples(live, stored) == (4, [])
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    assert compare_samples(live, safetensors_sample(tmp_path) or {}) == (4, [])
    with torch.no_grad():
        model[0].weight.mul_(1.001)  # every element moves, as a few training steps move them
    assert compare_samples(weights_sample(model) or {}, stored) == (4, ["0.weight"])


def test_tensors_in_another_dtype_or_shape_are_not_compared() -> None:
    model = _model()
    live = weights_sample(model) or {}
    other = weights_sample({"0.weight": model[0].weight.detach().half(), "2.bias": torch.zeros(5)}) or {}
    assert compare_samples(live, other) == (0, [])


def test_save_and_restore_events_carry_the_facts_and_read_back(tmp_path: Path) -> None:
    events: list[tuple[str, dict]] = []
    model = _model()
    with CheckpointManager(
        str(tmp_path / "ck"), async_save=True, on_event=lambda k, i: events.append((k, i))
    ) as m:
        m.save(3, model=model)
        m.wait()
        torch.rand(5)  # the run draws on after the save
        m.restore(3, model=_model(1))
    save = next(i for k, i in events if k == "save")
    restore = next(i for k, i in events if k == "restore")
    assert save["weights_sample"] == weights_sample(model)
    assert restore["rng_digests"] == save["rng_digests"]  # the restore put the captured state back
    assert save["facts_s"] >= 0
    with LedgerWriter(tmp_path / "run") as ledger:
        for kind, info in events:
            ledger.on_event(kind, info)
        ledger.step(4, 1.0, 1e-3)
    run = read_jsonl(tmp_path / "run" / "ledger.jsonl")
    (s,) = [e for e in run.sessions[0].events if isinstance(e, Save)]
    (r,) = [e for e in run.sessions[0].events if isinstance(e, Restore)]
    assert s.weights_sample == save["weights_sample"] and s.rng_digests == save["rng_digests"]
    assert r.rng_digests == restore["rng_digests"]


def _ledger(run: Path, saved: dict[str, str] | None, restored: dict[str, str] | None, overlap: bool) -> None:
    """Session 1: steps 1..10 and the save of 10 (crash at 10, or at 13 with overlap); session 2: restore 10."""
    with LedgerWriter(run, deterministic=False) as a:
        for s in range(1, 14 if overlap else 11):
            a.step(s, 2.0 - 0.01 * s, 1e-3, rng_digest=f"r{s}")
            if s == 10:
                a.save(10, "ck/step_10", rng_digests=saved)
    with LedgerWriter(run, deterministic=False) as b:
        b.restore(10, "ck/step_10", rng_digests=restored)
        for s in range(11, 20):
            b.step(s, 2.0 - 0.01 * s, 1e-3, rng_digest=f"r{s}")


@pytest.mark.parametrize("overlap", [False, True])
def test_rng_check_fails_on_the_saved_state_and_is_silent_without_it(tmp_path: Path, overlap: bool) -> None:
    saved = {"python": "a", "numpy": "b", "torch": "c"}
    cases = {
        "equal": (saved, dict(saved)),
        "lost": (saved, {**saved, "torch": "x", "cuda:0": "only-here"}),
        "older": (None, dict(saved)),  # a ledger written before the facts existed
    }
    out = {}
    for name, (s, r) in cases.items():
        _ledger(tmp_path / name, s, r, overlap)
        out[name] = verify_run(read_jsonl(tmp_path / name / "ledger.jsonl")).verdicts[0].check("rng")
    assert out["lost"].status is Status.FAIL and out["lost"].cause is Cause.RNG_NOT_RESTORED
    assert "1 stream of 3 (torch)" in out["lost"].summary and "checkpoint 10" in out["lost"].summary
    assert out["equal"].status is Status.PASS and out["equal"].numbers["streams"] == 3
    assert out["older"].status is not Status.FAIL and "streams" not in out["older"].numbers


def test_a_boundary_without_overlap_says_what_it_cannot_check(tmp_path: Path) -> None:
    _ledger(tmp_path / "plain", None, None, overlap=False)
    _ledger(tmp_path / "facts", {"torch": "c"}, {"torch": "c"}, overlap=False)
    _ledger(tmp_path / "both", None, None, overlap=True)
    plain = verify_run(read_jsonl(tmp_path / "plain" / "ledger.jsonl"))
    facts = verify_run(read_jsonl(tmp_path / "facts" / "ledger.jsonl"))
    both = verify_run(read_jsonl(tmp_path / "both" / "ledger.jsonl"))
    (note,) = [n for n in plain.notes if n.startswith("boundary 1")]
    assert "lr_scaled_silently" in note and "RNG state was restored" in note
    (fnote,) = [n for n in facts.notes if n.startswith("boundary 1")]
    assert "lr_scaled_silently" in fnote and "RNG" not in fnote
    assert not [n for n in both.notes if n.startswith("boundary")]
    assert plain.exit_code == 0 and "note: boundary 1" in render_text(plain)


# ------------------------------------------------------------------------------------------------ real runs
@pytest.fixture(scope="module")
def generator(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A small generator trunk crashed right after checkpoint 80 (no overlap), resumed clean, twice, from an
    older checkpoint, with stale weights in checkpoint 80 and with the RNG not applied."""
    root = tmp_path_factory.mktemp("gen")
    cfg = TruthConfig(size="small", seed=1, overlap=False)
    trunk(cfg, root)
    out = {}
    for d in ("clean", "clean_two_restarts", "older_checkpoint", "weights_stale", "rng_lost"):
        run = branch(cfg, root, d)
        out[d] = verify_run(load_run(run, "jsonl"), facts=ManifestFacts(str(checkpoints_dir(run))))
    out["root"] = root
    return out


def test_clean_generator_resumes_match_the_save_facts(generator: dict) -> None:
    for d in ("clean", "clean_two_restarts"):
        v = generator[d]
        assert v.exit_code == 0, render_text(v)
        for b in v.verdicts:
            # python, numpy, torch (and xla where another test imported torch_xla)
            assert b.check("rng").numbers.get("streams", 0) >= 3
            assert b.check("weights").numbers.get("sample_differs") == 0
    # a resume from a non-newest checkpoint: its own save event's facts match
    older = generator["older_checkpoint"]
    assert older.verdicts[0].boundary.restored_step == 60
    assert older.verdicts[0].check("rng").status is Status.PASS
    assert older.verdicts[0].check("weights").numbers.get("sample_differs") == 0


def test_stale_weights_without_overlap_fail_on_the_save_fingerprint(generator: dict) -> None:
    v = generator["weights_stale"]
    w = v.verdicts[0].check("weights")
    assert v.exit_code == 1 and w.status is Status.FAIL and w.cause is Cause.STALE_CHECKPOINT
    assert "does not hold step 80's weights" in w.summary and "early copy" in w.summary
    # the other branches share the trunk: the fingerprint saw what the planted file changed, nothing else
    assert generator["clean"].verdicts[0].check("weights").status is Status.PASS


def test_rng_not_applied_without_overlap_fails_on_the_saved_state(generator: dict) -> None:
    v = generator["rng_lost"]
    r = v.verdicts[0].check("rng")
    assert v.exit_code == 1 and r.status is Status.FAIL and r.cause is Cause.RNG_NOT_RESTORED
    assert "state saved with checkpoint 80" in r.summary


def test_a_checkpoint_without_the_fingerprint_is_judged_as_before(generator: dict, tmp_path: Path) -> None:
    """An older ledger (no save-time facts): the stale checkpoint is not caught, and nothing is guessed."""
    run = tmp_path / "old"
    shutil.copytree(Path(generator["root"]) / "weights_stale", run)
    lines = (run / "ledger.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines]
    for rec in recs:
        for key in ("weights_sample", "rng_digests"):
            rec.pop(key, None)
    (run / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    v = verify_run(load_run(run, "jsonl"), facts=ManifestFacts(str(checkpoints_dir(run))))
    w = v.verdicts[0].check("weights")
    assert w.status is not Status.FAIL and "sampled_tensors" not in w.numbers
    assert any("early copy" in n for n in v.notes)


def test_xla_tensors_are_left_out_of_the_fingerprint() -> None:
    """An XLA tensor's sample would be a graph to compile and run per tensor at every save: left out, the CPU
    tensors beside it still fingerprinted."""
    torch_xla = pytest.importorskip("torch_xla")
    model = {"cpu.weight": torch.arange(100.0), "xla.weight": torch.arange(100.0).to(torch_xla.device())}
    assert tensor_sample("xla.weight", model["xla.weight"]) is None
    assert set(weights_sample(model) or {}) == {"cpu.weight"}


def test_the_fingerprint_never_calls_state_dict() -> None:
    """It runs on rank 0 alone, and a wrapper's state_dict can be a collective (FSDP1's full state dict gathers over
    every rank): a module whose state_dict cannot be called is still fingerprinted, from its own tensors."""

    class Collective(torch.nn.Linear):
        def state_dict(self, *args: object, **kwargs: object) -> dict:  # type: ignore[override]
            raise AssertionError("state_dict is a collective here")

    model = Collective(4, 3)
    model.register_buffer("seen", torch.zeros(()))
    assert set(weights_sample(model) or {}) == {"weight", "bias", "seen"}

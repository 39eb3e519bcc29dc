"""The weights check of ``verify-resume`` on real runs: a training loop with ``ckpt.CheckpointManager`` and the run
ledger, restarted in new sessions (each a new ``LedgerWriter`` and manager, as a new process would make them).

* a restore that loads no tensor (the model was refactored and restored with ``strict=False``) is named: the
  weights after restore are not the checkpoint's;
* a checkpoint saved while an earlier step's weights were swapped in (an evaluation of the step-10 "best" weights,
  the save inside the swap) holds step 10's model at step 30, with the optimizer, scheduler and step current;
* clean restarts (one, and two in a row) stay continuous, the weights check passing at each boundary.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from ckpt.cli.main import cli
from ckpt.converters.digest import LiveDigest
from click.testing import CliRunner
from torch import nn

import ckpt
from ckpt.restoring.loader import Restorer
from ckpt.resume.checks import Cause, Status
from ckpt.resume.ledger import LedgerWriter, checkpoints_dir, digest_ids
from ckpt.resume.manifest_facts import ManifestFacts
from ckpt.resume.sources import load_run
from ckpt.resume.verify import verify_run
from ckpt.state.training import NamedTensor

SAVE_EVERY = 10


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Refactored(nn.Module):
    """The same network after a refactor that moved it under ``net.``: its state_dict names all changed."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, torch.sin(x[:, :4]) + 0.5 * x[:, 4:]


def session(run: Path, stop: int, *, bug: str | None = None) -> int | None:
    """One process of the run: restore the newest checkpoint, train to ``stop``, save every 10 steps."""
    torch.manual_seed(0)
    model: nn.Module = Refactored() if bug == "no_key_matches" else Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    with LedgerWriter(run, world_size=1, deterministic=True) as ledger:
        mgr = ckpt.CheckpointManager(str(checkpoints_dir(run)), async_save=False, on_event=ledger.on_event)
        if bug == "no_key_matches":
            restored = mgr.restore_latest(model=model, strict=False)  # loads nothing: every name differs
        else:
            restored = mgr.restore_latest(model=model, optimizer=opt, scheduler=sched)
        best: dict[str, torch.Tensor] = {}
        for step in range((restored or 0) + 1, stop + 1):
            x, y = batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            ledger.step(step, loss, lr, samples=16 * step, data_digest=digest_ids([step]))
            if step == 10:
                best = {k: v.clone() for k, v in model.state_dict().items()}
            if step % SAVE_EVERY:
                continue
            if bug == "save_while_swapped" and step == 30:
                current = {k: v.clone() for k, v in model.state_dict().items()}
                model.load_state_dict(best)  # evaluate the step-10 weights ...
                mgr.save(step, model=model, optimizer=opt, scheduler=sched)  # ... and save inside the swap
                model.load_state_dict(current)
            else:
                mgr.save(step, model=model, optimizer=opt, scheduler=sched)
        mgr.close()
    return restored


class CountingFacts(ManifestFacts):
    """The run's checkpoints, counting the reads of a checkpoint's data through the engine's HF view."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.hf_view_reads: list[int] = []

    def view_digest(self, step: int, path: str | None) -> object:
        self.hf_view_reads.append(step)
        return super().view_digest(step, path)


def verify(run: Path, facts: ManifestFacts | None = None):
    return verify_run(load_run(run), facts=facts or ManifestFacts(checkpoints_dir(run)))


def test_a_restore_that_loads_no_tensor_is_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    session(run, 25)
    assert session(run, 35, bug="no_key_matches") == 20
    result = verify(run)
    (v,) = result.verdicts
    w = v.check("weights")
    assert w.status is Status.FAIL and w.cause is Cause.WEIGHTS_NOT_RESTORED, w.summary
    assert "weights after restore differ from step_00000020's: not restored (4 of 4 tensors differ" in w.summary
    assert "fc1.weight" in w.summary and w.numbers["not_restored"] == 4
    assert result.exit_code == 1
    res = CliRunner().invoke(cli, ["verify-resume", str(run)], terminal_width=200)
    assert res.exit_code == 1 and "not restored (4 of 4 tensors differ" in res.output, res.output


def test_a_checkpoint_holding_an_earlier_steps_weights_is_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    session(run, 35, bug="save_while_swapped")
    assert session(run, 45) == 30
    result = verify(run)
    (v,) = result.verdicts
    w = v.check("weights")
    assert w.status is Status.FAIL and w.cause is Cause.STALE_CHECKPOINT, w.summary
    assert w.summary.startswith("step_00000030 holds the same model as step_00000010")
    assert w.numbers["same_as_step"] == 10
    # the restore itself was right: the model after it is step_00000030's (stale) weights
    assert v.check("counters").status is not Status.FAIL
    assert v.causes == [Cause.STALE_CHECKPOINT]  # the loss jump follows from it, not a second cause
    res = CliRunner().invoke(cli, ["verify-resume", str(run), "--json"])
    assert res.exit_code == 1, res.output
    (b,) = json.loads(res.output)["boundaries"]
    weights = next(c for c in b["checks"] if c["check"] == "weights")
    assert weights["cause"] == Cause.STALE_CHECKPOINT.value and weights["basis"] == "checkpoint facts"


@pytest.mark.parametrize("restarts", [1, 2])
def test_clean_restarts_stay_continuous(tmp_path: Path, restarts: int) -> None:
    run = tmp_path / "run"
    session(run, 25)
    assert session(run, 37) == 20
    if restarts == 2:
        assert session(run, 45) == 30
    facts = CountingFacts(checkpoints_dir(run))
    result = verify(run, facts)
    assert len(result.verdicts) == restarts
    assert facts.hf_view_reads == []  # the stored layout is the model's: digests from the chunk checksums alone
    for v in result.verdicts:
        w = v.check("weights")
        assert w.status is Status.PASS, w.summary
        assert f"weights after restore equal step_{v.boundary.restored_step:08d}'s (4 tensors)" in w.summary
        assert "differs from the" in w.summary
    assert result.exit_code == 0, [(c.name, c.summary) for v in result.verdicts for c in v.checks]
    res = CliRunner().invoke(cli, ["verify-resume", str(run)], terminal_width=200)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_restore_event_carries_the_digest_of_the_checkpoint_it_loaded(tmp_path: Path, codec: str) -> None:
    """The manager's digest is computed in the checkpoint's chunks: equal to the manifest's own digest (from the
    stored checksums for raw chunks, from the decoded data for zstd ones), by ``restore_latest`` (full manifest) and
    by ``restore(step)`` (format v2 read lazily: the chunks come from the indexes)."""
    from ckpt.converters.digest import source_digest

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with LedgerWriter(tmp_path, world_size=1) as ledger:
        mgr = ckpt.CheckpointManager(str(tmp_path / "ck"), async_save=False, codec=codec, on_event=ledger.on_event)
        mgr.save(3, model=model, optimizer=opt)
        assert mgr.restore_latest(model=model, optimizer=opt) == 3
        mgr.restore(3, model=model, optimizer=opt)
        with torch.no_grad():
            model.fc2.bias[1] += 1  # a model that is not the checkpoint's: its digest differs in that tensor
        changed_digest = live_digest(model, mgr.last_restore)
        ledger.on_event("restore", {"step": 3, "path": None, "model_digest": changed_digest.tensors})
        ledger.step(4, 1.0, 1e-2)  # a ledger holds steps
        mgr.close()
    want = source_digest(str(tmp_path / "ck" / "step_00000003")).tensors
    latest, by_step, changed = (r.model_digest for r in load_run(tmp_path).sessions[0].restores)
    assert latest == by_step == want and len(want) == 4
    assert [n for n in want if changed[n] != want[n]] == ["fc2.bias"]


def live_digest(model: nn.Module, result: ckpt.RestoreResult) -> LiveDigest:
    from ckpt.converters.digest import live_digest as digest

    from ckpt.format.reader import read_manifest
    from ckpt.storage import open_storage

    return digest(model, read_manifest(open_storage(result.path)))


NXD_TAG = Path(__file__).resolve().parents[1] / "fixtures/nxd/llama_gqa_h64/nxd_train_tp2_dp2_zero1_plain/step_3"


def _nxd_run(tmp_path: Path, stale: bool) -> tuple[Path, Path]:
    """NxD's own training tag as step_3, and as step_6 either unchanged (stale) or with one weight trained on; a
    ledger of a run that saved both and resumed from step_6."""
    tags = tmp_path / "tags"
    shutil.copytree(NXD_TAG, tags / "step_3")
    shutil.copytree(NXD_TAG, tags / "step_6")
    if not stale:
        f = tags / "step_6" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
        sd = torch.load(f, weights_only=True)
        name = next(n for n, t in sd.items() if t.is_floating_point())
        sd[name][0] += 1e-3
        torch.save(sd, f)
    run = tmp_path / "run"
    with LedgerWriter(run, world_size=1) as ledger:
        for step in range(1, 8):
            ledger.step(step, 2.0 - 0.1 * step, 1e-3)
            if step in (3, 6):
                ledger.save(step, tags / f"step_{step}")
    with LedgerWriter(run, world_size=1) as ledger:
        ledger.restore(6, tags / "step_6")
        for step in range(7, 10):
            ledger.step(step, 2.0 - 0.1 * step, 1e-3)
    return run, tags


@pytest.mark.parametrize("stale", [True, False])
def test_an_nxd_tag_holding_an_earlier_tags_weights_is_named(tmp_path: Path, stale: bool) -> None:
    run, tags = _nxd_run(tmp_path, stale)
    res = CliRunner().invoke(cli, ["verify-resume", str(run), "--checkpoints", str(tags), "--json"])
    (b,) = json.loads(res.stdout)["boundaries"]  # stderr: the copied tags' user_content.pt says step 3
    weights = next(c for c in b["checks"] if c["check"] == "weights")
    if stale:
        assert res.exit_code == 1 and weights["status"] == "fail", weights
        assert weights["summary"].startswith("step_6 holds the same model as step_3")
    else:
        assert weights["status"] == "pass" and "differs from the 1 earlier checkpoint" in weights["summary"], weights


# ------------------------------------------------------------------------ checkpoints in the Neuron layout
LLAMA = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 16, "tie_word_embeddings": False,
}  # fmt: skip


class FillsACopy(Restorer):
    """A backend restorer (``restore(restorer=)``) with a real bug class: each model tensor is read into a staging
    copy that is never copied back, so the model keeps its fresh initialisation."""

    def fill(self, nt: NamedTensor, entry_name: str) -> None:
        super().fill(dataclasses.replace(nt, tensor=nt.tensor.detach().clone()), entry_name)


def llama_session(run: Path, stop: int, dtype: torch.dtype = torch.float32, **restore: object) -> int | None:
    """One process of a tiny Llama run with ``ckpt.CheckpointManager``: restore the newest checkpoint (``restore``:
    extra arguments, the optimizer is left out with ``strict=False``), train to ``stop`` in ``dtype``, save every 10
    steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with LedgerWriter(run, world_size=1, deterministic=True) as ledger:
        mgr = ckpt.CheckpointManager(str(checkpoints_dir(run)), async_save=False, on_event=ledger.on_event)
        state = {"model": model} if restore.get("strict") is False else {"model": model, "optimizer": opt}
        restored = mgr.restore_latest(**state, **restore)
        for step in range((restored or 0) + 1, stop + 1):
            tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))
            loss = model(input_ids=tokens, labels=tokens).loss
            opt.zero_grad()
            loss.backward()
            lr = opt.param_groups[0]["lr"]
            opt.step()
            ledger.step(step, loss.item(), lr, samples=4 * step, data_digest=digest_ids([step]))
            if step % SAVE_EVERY == 0:
                mgr.save(step, model=model, optimizer=opt)
        mgr.close()
    model.config.to_json_file(str(run / "config.json"))
    return restored


def to_neuron(run: Path, step: int, tp: int, *args: str) -> None:
    """Replace the run's checkpoint of ``step`` with the same checkpoint in the Neuron layout (``ckpt convert --to
    neuron``: TP boxes, fused gate/up, NxD's KV replication and head order), as a Trainium run stores it."""
    ck = checkpoints_dir(run) / f"step_{step:08d}"
    res = CliRunner().invoke(
        cli, ["convert", str(ck), str(run / "neuron"), "--to", "neuron", "--tp", str(tp), "--config",
              str(run / "config.json"), *args],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    shutil.rmtree(ck)
    shutil.move(run / "neuron", ck)


@pytest.mark.parametrize("tp,args", [(2, ()), (4, ("--qkv-linear", "--kv-size-multiplier", "2"))])
def test_a_restore_checked_against_its_neuron_layout_checkpoint_passes(
    tmp_path: Path, tp: int, args: tuple[str, ...]
) -> None:
    """The checkpoint the run restored holds the restored weights in the Neuron layout (other boxes, a fused
    gate_up_proj; at TP 4 a fused, replicated QKV in NxD's head order): compared in the conversion engine's HF view,
    every tensor of the model equals it; the stored layout is never read as a failed restore."""
    run = tmp_path / "run"
    llama_session(run, 25)
    assert llama_session(run, 30) == 20
    to_neuron(run, 20, tp, *args)
    facts = CountingFacts(checkpoints_dir(run))
    result = verify(run, facts)
    assert facts.hf_view_reads == [20]
    (v,) = result.verdicts
    w = v.check("weights")
    assert w.status is Status.PASS, w.summary
    assert w.summary.startswith("weights after restore equal step_00000020's (12 tensors, in its HF view)")
    assert w.numbers["view"] == "hf" and w.numbers["compared"] == 12 and w.numbers["not_compared"] == 0
    assert result.exit_code == 0, [(c.name, c.summary) for c in v.checks]


def test_a_restore_that_left_fresh_weights_fails_against_its_neuron_layout_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    llama_session(run, 25)
    assert llama_session(run, 30, restorer=FillsACopy) == 20
    to_neuron(run, 20, 2)
    result = verify(run)
    (v,) = result.verdicts
    w = v.check("weights")
    assert w.status is Status.FAIL and w.cause is Cause.WEIGHTS_NOT_RESTORED, w.summary
    assert w.summary.startswith("weights after restore differ from step_00000020's (compared in its HF view): ")
    assert "not restored (12 of 12 tensors differ: model.embed_tokens.weight" in w.summary
    assert w.numbers["view"] == "hf" and w.numbers["not_restored"] == w.numbers["compared"] == 12
    assert result.exit_code == 1


def test_a_non_strict_restore_of_a_neuron_layout_checkpoint_names_what_it_left(tmp_path: Path) -> None:
    """``strict=False`` lets an HF model load a Neuron-layout checkpoint: the tensors of matching names are restored
    (equal in the checkpoint's own view), the fused gate_up_proj is not, and the MLP keeps its initialisation."""
    run = tmp_path / "run"
    llama_session(run, 25)
    to_neuron(run, 20, 2)
    assert llama_session(run, 30, strict=False) == 20
    result = verify(run)
    (v,) = result.verdicts
    w = v.check("weights")
    assert w.status is Status.FAIL and w.cause is Cause.WEIGHTS_NOT_RESTORED, w.summary
    assert "not restored (1 of 11 tensors differ: model.layers.0.mlp.gate_up_proj.weight; 1 the restore" in w.summary
    assert "model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.up_proj.weight left as they were" in w.summary
    assert w.numbers["view"] == "stored" and w.numbers["compared"] == 10


@pytest.mark.parametrize("saved,resumed", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_a_restore_into_another_dtype_is_compared_only_when_the_cast_is_exact(
    tmp_path: Path, saved: torch.dtype, resumed: torch.dtype
) -> None:
    """A BF16 checkpoint restored into an F32 model: the model cast back is the checkpoint's bytes, compared from
    the stored checksums.  An F32 checkpoint restored into a BF16 model: the cast lost bits, no view holds both in
    one dtype, and the comparison is skipped with the reason (before, it read as 12 tensors not restored)."""
    run = tmp_path / "run"
    llama_session(run, 25, saved)
    assert llama_session(run, 30, resumed) == 20
    facts = CountingFacts(checkpoints_dir(run))
    (v,) = verify(run, facts).verdicts
    assert facts.hf_view_reads == []  # whole tensors would not compare either: the checkpoint's data is not read
    w = v.check("weights")
    if saved == torch.bfloat16:
        assert w.status is Status.PASS and w.numbers["view"] == "stored", w.summary
        assert w.summary.startswith("weights after restore equal step_00000020's (12 tensors)")
    else:
        assert w.status is Status.SKIP and w.numbers["compared"] == 0, w.summary
        assert w.summary.endswith("step_00000020 differs from the 1 earlier checkpoint")  # that part is checked
        assert "weights after restore not compared with step_00000020's: 12 in another dtype, shape or layout (" in (
            w.summary
        )
        assert "the model's hf BF16[64, 32] whole, the checkpoint's hf F32[64, 32] whole" in w.summary


def test_a_restore_digest_logged_without_views_is_not_compared(tmp_path: Path) -> None:
    """A ledger written before restore events carried ``model_views``: the digest's boxes and view are unknown, so
    it is never read as a failed restore, even when the checkpoint is now in another layout."""
    run = tmp_path / "run"
    llama_session(run, 25)
    assert llama_session(run, 30) == 20
    to_neuron(run, 20, 2)
    ledger = run / "ledger.jsonl"
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert sum(r.pop("model_views", None) is not None for r in records) == 1
    ledger.write_text("".join(json.dumps(r) + "\n" for r in records))
    (v,) = verify(run).verdicts
    w = v.check("weights")
    assert w.status is Status.SKIP, w.summary
    assert w.summary == (
        "weights after restore not compared with step_00000020's: the restore digest was logged without the view "
        "of each tensor (by an older ckpt)"
    )

"""``ckpt compare``: real tiny training runs (torch MLP, AdamW, warmup + cosine LR, controlled data order)
written with :class:`LedgerWriter`, compared as a migration check would compare a GPU and a Trainium run.

What each case proves:

- the same run twice agrees bit for bit (exit 0, no divergent step);
- a run in float64, or with bf16 autocast, agrees within the calibrated tolerance: numerics alone do not
  raise a false alarm, yet the losses do differ (the tolerance is doing the work);
- a different LR schedule is named at the exact step where it starts and the curves diverge (exit 1);
- a shuffled data order is flagged by the digests at the first step;
- the same run read from a TensorBoard event file (float32 scalars) and from its ledger agrees;
- resumed runs are compared on their effective curve (the resumed session's values win);
- the CLI: exit codes, ``--json``, ``--plot`` writes a PNG, bad input is one line with exit 2.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from ckpt.cli.main import cli
from click.testing import CliRunner

from ckpt.resume.compare import compare_runs, env_summary
from ckpt.resume.ledger import LedgerWriter, digest_ids
from ckpt.resume.sources import load_run

STEPS = 80
BATCH = 64
SAMPLES = 2048
PEAK_LR = 1e-2
WARMUP = 10
HOT_FROM = 40
HOT = 30
"""The ``hot`` schedule multiplies the LR by HOT from step HOT_FROM on (a wrong peak LR in a config of the
resumed half, say): the first LR difference is at HOT_FROM, and the loss jumps soon after."""


def _lr_factor(schedule: str, step: int) -> float:
    """LR multiplier for 1-based ``step``: linear warmup, then cosine to 10%; ``hot`` jumps at HOT_FROM."""
    if step <= WARMUP:
        f = step / WARMUP
    else:
        f = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))
    if schedule == "hot" and step >= HOT_FROM:
        f *= HOT
    return f


def train(
    run_dir: Path,
    *,
    precision: str = "float32",
    schedule: str = "cosine",
    data_seed: int = 0,
    tensorboard: Path | None = None,
    tokenizer: str = "tiny-tok@0123456789abcdef",
    env: dict[str, object] | None = None,
    steps: tuple[int, int] = (1, STEPS),
    resume_state: dict | None = None,
) -> dict:
    """Train a tiny classifier for ``steps`` (inclusive) and log every step; returns the state to resume.

    Data: a fixed synthetic set (teacher MLP labels with noise), batches drawn from a per-epoch permutation
    of ``data_seed``.  Weights are initialised in float32 from seed 0 whatever ``precision``, so all
    variants start from the same point.
    """
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, 16, generator=gen)
    teacher = torch.randn(16, 4, generator=gen)
    y = (x @ teacher + 0.8 * torch.randn(SAMPLES, 4, generator=gen)).argmax(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    if precision == "float64":
        model, x = model.double(), x.double()
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: _lr_factor(schedule, i + 1))
    if resume_state is not None:
        resume_state = copy.deepcopy(resume_state)  # the optimizer may keep the very tensors it is given
        model.load_state_dict(resume_state["model"])
        opt.load_state_dict(resume_state["opt"])
        sched.load_state_dict(resume_state["sched"])
    per_epoch = SAMPLES // BATCH
    tb = None
    if tensorboard is not None:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(str(tensorboard))
    with LedgerWriter(run_dir, seed=0, deterministic=True, tokenizer_id=tokenizer, extra_env=env) as ledger:
        if resume_state is not None:
            ledger.restore(steps[0] - 1, "memory")
        for step in range(steps[0], steps[1] + 1):
            epoch, pos = divmod(step - 1, per_epoch)
            order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(data_seed * 1000 + epoch))
            ids = order[pos * BATCH : (pos + 1) * BATCH]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                logits = model(x[ids])
            loss = torch.nn.functional.cross_entropy(logits.float(), y[ids])
            opt.zero_grad()
            loss.backward()
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            ledger.step(step, loss, lr, data_digest=digest_ids(ids))
            if tb is not None:
                tb.add_scalar("train/loss", loss.item(), step)
                tb.add_scalar("train/lr", lr, step)
    if tb is not None:
        tb.close()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> None:
    # Bitwise reproducibility of the "same run twice" case, and no fight over the shared cores.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out: dict[str, Path] = {}
    variants = {
        "ref": {"tensorboard": root / "ref-tb"},
        "again": {},
        "float64": {"precision": "float64"},
        "bf16": {"precision": "bf16"},
        "hot": {"schedule": "hot"},
        "shuffled": {"data_seed": 7},
    }
    for name, kw in variants.items():
        train(root / name, **kw)  # type: ignore[arg-type]
        out[name] = root / name
    out["ref-tb"] = root / "ref-tb"
    return out


def invoke(*args: object):
    return CliRunner().invoke(cli, ["compare", *(str(a) for a in args)], terminal_width=200)


# -- the library ---------------------------------------------------------------------------------------
def test_same_run_twice_agrees_bit_for_bit(runs: dict[str, Path]) -> None:
    c = compare_runs(load_run(runs["ref"]), load_run(runs["again"]))
    assert c.agree and c.exit_code == 0 and c.problems == []
    assert len(c.steps) == STEPS and c.loss.compared == STEPS
    assert c.loss.bitwise_equal and c.loss.max_abs_diff == 0 and c.loss.diverging == []
    assert c.drift.last == 0 and not c.drift.significant
    assert c.lr.status == "equal" and c.lr.compared == STEPS
    assert c.data.status == "equal" and c.tokenizer == "equal"
    assert c.loss.noise_floor > 0 and c.loss.tolerance == pytest.approx(5 * c.loss.noise_floor)


@pytest.mark.parametrize("variant", ["float64", "bf16"])
def test_other_precision_agrees_within_calibrated_tolerance(runs: dict[str, Path], variant: str) -> None:
    c = compare_runs(load_run(runs["ref"]), load_run(runs[variant]))
    assert c.agree, c.problems
    assert not c.loss.bitwise_equal and c.loss.max_abs_diff > 0  # the numerics do differ ...
    assert c.loss.max_abs_diff < c.loss.tolerance  # ... within the band, with room to spare:
    assert c.loss.max_abs_diff < 0.5 * c.loss.tolerance
    assert c.lr.status == "equal" and c.data.status == "equal"
    assert not c.drift.significant


def test_different_lr_schedule_is_named_at_its_step_and_diverges(runs: dict[str, Path]) -> None:
    c = compare_runs(load_run(runs["ref"]), load_run(runs["hot"]))
    assert not c.agree and c.exit_code == 1
    assert c.lr.status == "different" and c.lr.first_mismatch == HOT_FROM
    assert c.lr.mismatched == STEPS - HOT_FROM + 1
    assert c.lr.b == pytest.approx(HOT * c.lr.a)
    assert c.loss.first_divergence is not None and c.loss.first_divergence > HOT_FROM
    assert c.drift.significant
    assert c.problems[0].startswith(f"LR differs from step {HOT_FROM}")
    assert c.data.status == "equal"


def test_shuffled_data_order_is_flagged(runs: dict[str, Path]) -> None:
    c = compare_runs(load_run(runs["ref"]), load_run(runs["shuffled"]))
    assert not c.agree and c.exit_code == 1
    assert c.data.status == "same batches, different order" or c.data.status == "different batches"
    assert c.data.first_mismatch == 1 and c.data.mismatched == STEPS
    assert any("data order differs" in p for p in c.problems)
    assert c.lr.status == "equal"


def test_tensorboard_vs_ledger_of_the_same_run_agrees(runs: dict[str, Path]) -> None:
    tb = load_run(runs["ref-tb"])
    assert tb.source == "tensorboard" and tb.precision == "float32"
    c = compare_runs(load_run(runs["ref"]), tb)
    assert c.agree, c.problems
    assert c.lr.status == "equal" and c.lr.compared == STEPS  # float64 vs float32 compared at float32
    assert c.loss.max_abs_diff < 1e-6 and c.loss.diverging == []
    ref, f32 = c.a.curve, c.b.curve
    assert any(ref[s].lr != f32[s].lr for s in c.steps)  # the LRs differ in float64, equal in float32
    assert c.env_differences == [] and env_summary(c.b.env) == "not logged"
    assert c.data.status == "not logged" and c.tokenizer == "not logged"


def test_resumed_run_is_compared_on_its_effective_curve(tmp_path: Path, runs: dict[str, Path]) -> None:
    # Session 1 trains 1..30 in bf16 with a bad LR (a dead session); session 2 resumes float32 state of step
    # 20 and trains 21..80.  Steps 21..30 are logged twice; the resumed session's values must be the ones
    # compared, so the run agrees with the straight reference everywhere.
    run = tmp_path / "resumed"
    state = train(tmp_path / "scratch", steps=(1, 20))
    train(run, steps=(1, 20))
    train(run, steps=(21, 30), precision="bf16", resume_state=state)  # its values must not count
    train(run, steps=(21, STEPS), resume_state=state)
    c = compare_runs(load_run(runs["ref"]), load_run(run))
    assert len(load_run(run).sessions) == 3
    assert c.agree, c.problems
    assert c.loss.bitwise_equal and c.lr.status == "equal" and len(c.steps) == STEPS


def test_tokenizer_and_environment_differences_are_named(tmp_path: Path, runs: dict[str, Path]) -> None:
    trn = tmp_path / "trn"
    train(
        trn,
        tokenizer="other-tok@fedcba9876543210",
        env={"backend": "neuron", "torch_xla": "2.8.0", "neuronx_cc": "2.21.0", "world_size": 32},
    )
    c = compare_runs(load_run(runs["ref"]), load_run(trn), labels=("gpu", "trn"))
    assert c.tokenizer == "different" and not c.agree
    assert any("tokenizer differs" in p for p in c.problems)
    keys = {k for k, _, _ in c.env_differences}
    assert {"backend", "torch_xla", "neuronx_cc", "world_size"} <= keys and "hostname" not in keys
    assert env_summary(c.b.env).startswith(
        "neuron torch "
    ) and "torch-xla 2.8.0 neuronx-cc 2.21.0" in env_summary(c.b.env)
    assert c.loss.bitwise_equal  # only the labels differ: the curves themselves agree


def test_explicit_tolerances(runs: dict[str, Path]) -> None:
    a, b = load_run(runs["ref"]), load_run(runs["bf16"])
    tight = compare_runs(a, b, tolerance=1e-9)
    assert not tight.agree and tight.loss.tolerance_mode == "absolute"
    assert tight.loss.first_divergence == tight.loss.diverging[0]
    loose = compare_runs(a, b, rtol=0.5)
    assert loose.agree and loose.loss.tolerance_mode == "relative"


# -- the command ---------------------------------------------------------------------------------------
def test_cli_agree_exits_0_with_a_table(runs: dict[str, Path]) -> None:
    r = invoke(runs["ref"], runs["float64"], "--label-a", "gpu", "--label-b", "trn")
    assert r.exit_code == 0, r.output
    for text in ("AGREE", "learning rate", "noise floor", "drift", "data order", "tokenizer", "environment"):
        assert text in r.output


def test_cli_diverge_exits_1_and_names_the_lr_step(runs: dict[str, Path]) -> None:
    r = invoke(runs["ref"], runs["hot"])
    assert r.exit_code == 1, r.output
    assert "DIVERGE" in r.output and f"LR differs from step {HOT_FROM}" in r.output


def test_cli_json(runs: dict[str, Path]) -> None:
    r = invoke(runs["ref"], runs["shuffled"], "--json")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.output)
    assert doc["verdict"] == "diverge" and doc["exit_code"] == 1
    assert doc["steps_compared"] == STEPS and doc["data"]["first_mismatch"] == 1
    assert doc["lr"]["status"] == "equal" and isinstance(doc["loss"]["noise_floor"], float)
    assert doc["a"]["source"] == "jsonl" and doc["environment"]["a"] == doc["environment"]["b"]


def test_cli_tensorboard_source(runs: dict[str, Path]) -> None:
    r = invoke(runs["ref"], runs["ref-tb"], "--source-b", "tensorboard", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["b"]["precision"] == "float32"


def test_cli_plot_writes_a_png(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "compare.png"
    r = invoke(runs["ref"], runs["hot"], "--plot", out, "--label-a", "gpu", "--label-b", "trn")
    assert r.exit_code == 1, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["{tmp}/missing", "{ref}"], "does not exist"),
        (["{ref}", "{ref}", "--tolerance", "0.1", "--rtol", "0.1"], "either --tolerance or --rtol"),
        (["{ref}", "{ref}", "--tolerance", "-1"], "--tolerance must be"),
        (["{ref}", "{ref}", "--source-b", "csv"], "CSV"),
        (["{ref}", "{short}"], "no step in common"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(
    runs: dict[str, Path], tmp_path: Path, args: list[str], message: str
) -> None:
    short = tmp_path / "short"
    with LedgerWriter(short) as ledger:
        ledger.step(1000, 1.0, 0.1)
    r = CliRunner().invoke(
        cli,
        ["compare", *(a.format(tmp=tmp_path, ref=runs["ref"], short=short) for a in args)],
        terminal_width=200,
    )
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckpt: error: ") and message in lines[0], r.output


def test_small_systematic_offset_is_caught_by_the_drift_not_the_band(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    # B = A + 0.1 from step 41 on (CSV logs of the reference run): inside the per-step band (5 noise floors,
    # ~0.3) at every step, but the last window's median difference is far beyond its standard error.
    ref = load_run(runs["ref"])
    rows = [r for s in ref.sessions for r in s.steps]
    for name, offset in (("a", 0.0), ("b", 0.1)):
        lines = ["step,loss,lr"]
        lines += [f"{r.step},{r.loss + (offset if r.step > 40 else 0.0)!r},{r.lr!r}" for r in rows]
        (tmp_path / f"{name}.csv").write_text("\n".join(lines) + "\n")
    c = compare_runs(load_run(tmp_path / "a.csv"), load_run(tmp_path / "b.csv"))
    assert c.loss.diverging == [] and c.loss.max_abs_diff < c.loss.tolerance
    assert c.drift.significant and c.drift.last == pytest.approx(0.1)
    assert c.exit_code == 1 and c.problems == [c.problems[0]] and "drifts apart" in c.problems[0]
    assert c.lr.status == "equal" and c.data.status == "not logged"

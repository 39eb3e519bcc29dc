"""Every command example in README.md and docs/*.md runs as written (issue 29: "doc examples collected and executed").

The examples are collected from the docs when the tests are collected, so an example added to any doc is run too:

- each fenced ``bash``/``sh``/``console``/unlabelled block line that starts with ``ckpt``, ``python``,
  ``python3`` or ``.venv/bin/`` (``\\``-continued lines joined) is run by ``bash`` in one shared workspace,
  verbatim, with ``ckpt``/``python`` on ``PATH`` meaning this checkout's; it must exit 0 (or its
  :data:`EXPECTED_EXIT`);
- a usage synopsis (a ``ckpt CMD ...`` block with ``[--flag ...]`` groups) is checked against ``ckpt CMD --help``:
  every flag it names exists;
- ``ckpt convert --help``'s ``Examples:`` are run like the docs' commands.

The workspace holds real inputs under the names the docs use (:func:`workspace`): a run trained with
``CheckpointManager`` and ``LedgerWriter`` (``runs/small-gpu``), the same run crashed and resumed with its
checkpoint in the Neuron layout (``runs/small-trn``), its TensorBoard log (``tb_logs/trn``), a Trainer checkpoint
(``out/checkpoint-1000``), NxD LoRA tags made from the PEFT adapter of ``fixtures/nxd_lora``, ``examples/``
(``examples/tiny_llama.py`` runs), ...  Names the docs use as placeholders are mapped in :data:`SUBSTITUTE`;
commands that need what no test machine has are listed in :data:`NOT_RUN` with the reason.  Both tables are the
place to extend when a doc gains an example.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIXTURES = ROOT / "fixtures"

#: command (as written, after joining continuations) -> why it is not run here; matched by prefix
NOT_RUN: dict[str, str] = {
    "python3 -m venv .venv": "creates a virtualenv and installs from PyPI (network); `ckpt demo` runs in test_demo.py",
    ".venv/bin/python -m pytest": "the whole test suite, this file included",
    'ckpt verify-resume runs/small-trn --replay "torchrun --nproc-per-node 32 train.py': "the user's own train.py on 32 torchrun processes; --replay runs in verify-resume.md's tiny_llama example",
    "ckpt ls run": "an accelerate run's folder (checkpoints/checkpoint_N): tests/test_accelerate.py lists one beside ours",
    "ckpt convert run/checkpoints/checkpoint_3 ": (
        "an accelerate run's save_state folder of an HF model; tests/test_accelerate.py converts real ones both ways"
    ),
    "ckpt convert trn/step_2400 gpu/checkpoint_7 ": "the Trainium run of the line above; tests/test_accelerate.py",
    ".venv/bin/python bench/verify_resume_truth.py": "a ~5 min benchmark (80 training runs); its runs' generator is tested in tests/test_resume_truth.py",
    "ckpt ls runs/": "guide.md's Lightning section: the same commands on files real Lightning wrote run in tests/test_lightning_files.py",
    "ckpt convert epoch=0-step=8.ckpt": "guide.md's Lightning section: the same commands on files real Lightning wrote run in tests/test_lightning_files.py",
    "ckpt convert ours/ back.ckpt": "guide.md's Lightning section: the same commands on files real Lightning wrote run in tests/test_lightning_files.py",
    "ckpt convert hf/ nxd/": "guide.md's Lightning section: the same commands on files real Lightning wrote run in tests/test_lightning_files.py",
}

#: text in a documented command -> what the workspace calls it (placeholders only; keep this short)
SUBSTITUTE: dict[str, str] = {
    # guide.md's NxD Training section: the config of the run's model; config.json has Llama-3-8B's head ratio
    "llama3_8B/config.json": "config.json",
}

#: command prefix -> documented exit code other than 0
EXPECTED_EXIT: dict[str, int] = {}

# -------------------------------------------------------------------------------------------- collection


@dataclass(frozen=True)
class Example:
    doc: str  # e.g. docs/guide.md
    line: int
    text: str  # the command, continuations joined
    synopsis: bool = False

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


_COMMAND = re.compile(r"^\s*(ckpt|python3?|\.venv/bin/)")
_SHELL_LANGS = {"", "bash", "sh", "shell", "console"}


def _blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """(language, first body line number, body lines) of each fenced block."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append((m.group(1), i + 2, lines[i + 1 : j]))
            i = j
        i += 1
    return out


def _strip_comment(cmd: str) -> str:
    """``cmd  # note`` -> ``cmd``; a ``#`` inside quotes stays."""
    quote = None
    for i, ch in enumerate(cmd):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and i > 0 and cmd[i - 1].isspace():
            return cmd[:i].rstrip()
    return cmd.rstrip()


def _commands(body: list[str], first: int) -> list[tuple[int, str]]:
    out, buf, start = [], "", 0
    for k, raw in enumerate(body):
        if buf:
            buf += " " + raw.strip()
        elif _COMMAND.match(raw):
            buf, start = raw.strip(), first + k
        else:
            continue
        if buf.endswith("\\"):
            buf = buf[:-1].rstrip()
            continue
        out.append((start, buf))
        buf = ""
    return out


def collect(docs: list[Path] = DOCS) -> list[Example]:
    found = []
    for path in docs:
        rel = str(path.relative_to(ROOT))
        for lang, first, body in _blocks(path):
            if lang not in _SHELL_LANGS:
                continue
            if body and body[0].startswith("ckpt ") and any(" [--" in ln for ln in body):
                found.append(Example(rel, first, " ".join(ln.strip() for ln in body), synopsis=True))
                continue
            found += [Example(rel, line, _strip_comment(cmd)) for line, cmd in _commands(body, first)]
    return found


def help_examples() -> list[Example]:
    """The ``Examples:`` of ``ckpt convert --help`` (the epilog users copy first)."""
    from ckpt.cli.convert import EPILOG

    lines = EPILOG.splitlines()
    return [
        Example("ckpt convert --help", n + 1, _strip_comment(ln.strip()))
        for n, ln in enumerate(lines)
        if ln.strip().startswith("ckpt convert ")
    ]


EXAMPLES = collect()
COMMANDS = [e for e in EXAMPLES if not e.synopsis] + help_examples()
SYNOPSES = [e for e in EXAMPLES if e.synopsis]


def _not_run(cmd: str) -> str | None:
    return next((why for prefix, why in NOT_RUN.items() if cmd.startswith(prefix)), None)


def test_the_docs_hold_examples_and_the_tables_name_only_real_ones() -> None:
    """The collector finds the docs' commands, and every allow-list entry still matches a documented command."""
    assert len(COMMANDS) >= 20 and len(SYNOPSES) >= 2
    for table in (NOT_RUN, EXPECTED_EXIT):
        for prefix in table:
            assert any(e.text.startswith(prefix) for e in COMMANDS), f"{prefix!r} is no longer in the docs"
    for text in SUBSTITUTE:
        assert any(text in e.text for e in COMMANDS), f"substitution {text!r} is no longer used by the docs"


# -------------------------------------------------------------------------------------------- synopses


def _help(command: str) -> str:
    from ckpt.cli.main import cli
    from click.testing import CliRunner

    res = CliRunner().invoke(cli, [command, "--help"], terminal_width=200)
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("example", SYNOPSES, ids=lambda e: e.id)
def test_synopsis_names_only_flags_the_command_has(example: Example) -> None:
    groups = re.split(r"(?=\bckpt [a-z][a-z-]* )", example.text)
    for group in filter(None, (g.strip() for g in groups)):
        command = group.split()[1]
        known = set(re.findall(r"--[a-z][a-z0-9-]*", _help(command)))
        named = set(re.findall(r"--(?:\[no-\])?[a-z][a-z0-9-]*", group.replace("--[no-]", "--no-")))
        named |= {"--" + f[5:] for f in named if f.startswith("--no-")}
        missing = sorted(f for f in named if f not in known and f.replace("--no-", "--") not in known)
        assert not missing, f"{example.id}: `ckpt {command}` has no {', '.join(missing)}"


# -------------------------------------------------------------------------------------------- workspace

STEPS, SAVE_AT, CRASH_AFTER = 510, 500, 505


def _llama3_shaped_config() -> object:
    """A tiny Llama with Llama-3-8B's head ratio (32 query heads, 8 KV heads): the docs' `--tp 8` examples fit it."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip


def _train(run: Path, stop_at: int) -> None:
    """The loop of docs/run-dir.md: CheckpointManager logging into the run's ledger; restores the newest checkpoint."""
    import torch
    from transformers import LlamaForCausalLM

    import ckpt
    from ckpt.resume.ledger import LedgerWriter, checkpoints_dir, digest_ids, digest_rng

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama3_shaped_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    with LedgerWriter(run, world_size=1, deterministic=True) as ledger:
        mgr = ckpt.CheckpointManager(str(checkpoints_dir(run)), keep_last=3, on_event=ledger.on_event)
        start = (mgr.restore_latest(model=model, optimizer=opt, scheduler=sched) or 0) + 1
        for step in range(start, stop_at + 1):
            rng_d = digest_rng()
            ids = torch.arange(step * 4, step * 4 + 4)
            tokens = (ids[:, None] * 7 + torch.arange(16)) % 128
            loss = model(input_ids=tokens, labels=tokens).loss
            opt.zero_grad()
            loss.backward()
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            ledger.step(
                step,
                loss.item(),
                lr,
                samples=step * 4,
                data_digest=digest_ids(ids.tolist()),
                rng_digest=rng_d,
            )
            if step == SAVE_AT:
                mgr.save(step, progress={"samples": step * 4}, model=model, optimizer=opt, scheduler=sched)
        mgr.close()
    model.config.to_json_file(str(run / "config.json"))


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def _invoke(args: list[str], cwd: Path) -> tuple[int, str, str]:
    """``ckpt ARGS`` in this process (the CLI users run, without a fresh interpreter per command)."""
    from ckpt.cli.main import cli
    from click.testing import CliRunner

    with _cwd(cwd):
        res = CliRunner().invoke(cli, args, terminal_width=160)
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        import traceback

        return 99, "".join(traceback.format_exception(*res.exc_info)), res.stdout
    return res.exit_code, res.stderr, res.stdout


def _ckpt(*args: object, cwd: Path) -> None:
    code, err, _ = _invoke([str(a) for a in args], cwd)
    assert code == 0, f"preparing: ckpt {' '.join(map(str, args))}: {err[-2000:]}"


def _shims(bin_dir: Path) -> None:
    """`ckpt`, `python`, `python3` on PATH: this checkout's, with the interpreter running the tests."""
    bin_dir.mkdir()
    for name, target in (("ckpt", f'"{sys.executable}" -m ckpt'), ("python", f'"{sys.executable}"')):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        (bin_dir / name).chmod(0o755)
    shutil.copy(bin_dir / "python", bin_dir / "python3")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The inputs the docs name, real and small; the examples' outputs land here too."""
    import torch
    from transformers import LlamaForCausalLM

    ws = tmp_path_factory.mktemp("docs")
    _shims(ws / ".bin")
    (ws / "examples").symlink_to(ROOT / "examples")
    torch.set_num_threads(1)
    # A run crashed after step 505 and resumed from its step-500 checkpoint; then a copy of it.
    small_gpu, small_trn = ws / "runs" / "small-gpu", ws / "runs" / "small-trn"
    _train(small_gpu, CRASH_AFTER)
    shutil.copytree(small_gpu, small_trn)
    for run in (small_gpu, small_trn):
        _train(run, STEPS)
    shutil.copy(small_gpu / "config.json", ws / "config.json")
    gpu500 = small_gpu / "checkpoints" / "step_00000500"
    # The Trainium run's checkpoint in the Neuron layout (TP 8), as NeuronCheckpointManager writes it.
    trn500 = small_trn / "checkpoints" / "step_00000500"
    _ckpt(
        "convert", gpu500, ws / "neuron500", "--to", "neuron", "--tp", "8", "--config", "config.json", cwd=ws
    )
    shutil.rmtree(trn500)
    shutil.move(ws / "neuron500", trn500)
    _tensorboard(small_trn, ws / "tb_logs" / "trn")
    # README: a Trainer checkpoint, and a Neuron-layout checkpoint of step 2000.
    _ckpt("convert", gpu500, ws / "out" / "checkpoint-1000", "--to", "cuda", "--format", "hf-trainer",
          "--step", "1000", "--config", "config.json", cwd=ws)  # fmt: skip
    _ckpt("convert", gpu500, ws / "trn" / "step_2000", "--to", "neuron", "--tp", "8", "--step", "2000",
          "--config", "config.json", cwd=ws)  # fmt: skip
    # convert --help: an NxD tag, an HF model, a big checkpoint.
    _ckpt("convert", gpu500, ws / "run" / "step_1000", "--to", "neuron", "--format", "nxd", "--tp", "2",
          "--config", "config.json", "--step", "1000", cwd=ws)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(_llama3_shaped_config()).save_pretrained(ws / "hf_model")
    shutil.copytree(gpu500, ws / "big")
    _nxd_training(ws, gpu500)
    _optimum_neuron(ws, tmp_path_factory.mktemp("optimum_neuron"))
    # LoRA: a PEFT adapter on hf_model (the base), and the NxD tag a Trainium LoRA job saves.
    _lora_adapter(ws / "hf_model", ws / "peft_adapter")
    for name in ("base", "base_hf"):
        shutil.copytree(ws / "hf_model", ws / name)
    for tag in (ws / "runs" / "lora-trn" / "step_500", ws / "run" / "lora_step_500"):
        _ckpt("convert", "peft_adapter", tag, "--to", "neuron", "--format", "nxd", "--tp", "2", "--qkv-linear",
              "--config", "base/config.json", cwd=ws)  # fmt: skip
    # verify-resume.md: examples/tiny_llama.py killed after step 23 and resumed
    for extra in (["--kill-at", "23"], []):
        subprocess.run(
            [sys.executable, "examples/tiny_llama.py", "--run", "runs/tiny", "--steps", "40", *extra],
            cwd=ws, capture_output=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    assert (ws / "runs" / "tiny" / "ledger.jsonl").exists()
    # README's DCP example and the guide's loader example: a checkpoint of the snippets' model, optimizer, loader
    import ckpt

    user = _namespace(ws, ws)
    next(iter(user["loader"]))
    ckpt.save(str(ws / "ckpt" / "step_00001000"), step=1000, model=user["model"], optimizer=user["opt"],
              dataloader=user["loader"])  # fmt: skip
    return ws


def _nxd_training(ws: Path, gpu500: Path) -> None:
    """guide.md's and convert --help's NxD Training examples: the GPU job's Trainer checkpoints and the NxD Training
    tags of the same model (``--config config.json``), named by NxD Training's template.  The Lightning-made tag of
    fixtures/nxdt is another model (llama_gqa_h64) at step 3, so it cannot stand under these names and config; the
    tags are what the documented GPU -> Trainium command writes (that NxD Training's restore takes such a tag, and a
    Trainer resumes from its way back: tests/test_nxdt.py)."""
    for folder, step in (
        ("out/checkpoint-10", 10),
        ("gpu/checkpoint-800", 800),
        ("gpu/checkpoint-1500", 1500),
    ):
        _ckpt("convert", gpu500, folder, "--to", "cuda", "--format", "hf-trainer", "--step", step,
              "--config", "config.json", cwd=ws)  # fmt: skip
    tags = {
        "out/checkpoint-1000": "exp/checkpoints/hf_llama3_8B--step=1000-consumed_samples=1024000.0.ckpt",
        "out/checkpoint-10": "exp/checkpoints/llama--step=10-consumed_samples=1280.0.ckpt",
    }
    for src, tag in tags.items():
        samples = tag.rsplit("=", 1)[1].split(".")[0]
        _ckpt("convert", src, tag, "--to", "neuron", "--format", "nxdt", "--tp", "8", "--dp", "2", "--qkv-linear",
              "--consumed-samples", samples, cwd=ws)  # fmt: skip


def _optimum_neuron(ws: Path, scratch: Path) -> None:
    """guide.md's optimum-neuron examples: NeuronTrainer ``checkpoint-N`` folders built by
    fixtures/optimum_neuron/build.py (README there), a full run's with NeuronTrainer's default xser files and a LoRA
    run's, with the LoRA run's base model.  The built folders hold steps 3 and 5 under the docs' ``checkpoint-500``:
    the step is read from ``trainer_state.json``, never from the folder's name (guide.md)."""
    spec = importlib.util.spec_from_file_location(
        "optimum_neuron_build", FIXTURES / "optimum_neuron" / "build.py"
    )
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    for made, folder in ((build.build(scratch, "xser"), "run"), (build.build_lora(scratch), "lora_run")):
        (ws / folder).mkdir(exist_ok=True)
        shutil.move(made, ws / folder / "checkpoint-500")
    shutil.copytree(FIXTURES / "nxd_lora" / "base", ws / "base_model")


def _lora_adapter(base: Path, dst: Path) -> None:
    """PEFT's LoraConfig on the base, every matrix non-zero; q/k/v and gate/up share lora_A, as an adapter trained
    with NxD's fused layers does (GQAQKVColumnParallelLinear, gate_up_proj)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules=targets)
    )
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for layer in model.base_model.model.model.layers:
            a = layer.self_attn.q_proj.lora_A["default"].weight
            layer.self_attn.k_proj.lora_A["default"].weight.copy_(a)
            layer.self_attn.v_proj.lora_A["default"].weight.copy_(a)
            layer.mlp.up_proj.lora_A["default"].weight.copy_(layer.mlp.gate_proj.lora_A["default"].weight)
    model.save_pretrained(dst)


def _tensorboard(run: Path, logdir: Path) -> None:
    """The run's effective loss/LR curve as TensorBoard scalars (what a Trainium job's SummaryWriter logs)."""
    from torch.utils.tensorboard import SummaryWriter

    from ckpt.resume.sources import load_run

    steps = {r.step: r for s in load_run(run).sessions for r in s.steps}
    with SummaryWriter(str(logdir)) as w:
        for step, r in sorted(steps.items()):
            w.add_scalar("train/loss", r.loss, step)
            w.add_scalar("lr", r.lr, step)


def _destination(cmd: str) -> str | None:
    """DST of a `ckpt convert SRC DST ...` (removed first, so that a re-run starts clean)."""
    words = shlex.split(cmd)
    return words[3] if words[:2] == ["ckpt", "convert"] and len(words) > 3 else None


@pytest.mark.parametrize("example", COMMANDS, ids=lambda e: e.id)
def test_documented_command_runs_as_written(
    example: Example, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    why = _not_run(example.text)
    if why is not None:
        pytest.skip(f"not run here: {why}")
    cmd = example.text
    for text, replacement in SUBSTITUTE.items():
        cmd = cmd.replace(text, replacement)
    dst = _destination(cmd)
    if dst is not None and "--dry-run" not in cmd:
        shutil.rmtree(workspace / dst, ignore_errors=True)
    env = {
        **os.environ,
        "PATH": f"{workspace / '.bin'}{os.pathsep}{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "COLUMNS": "160",
    }
    for key in ("PATH", "OMP_NUM_THREADS", "PYTHONWARNINGS"):  # what a command started by this one sees
        monkeypatch.setenv(key, env[key])
    words = shlex.split(cmd)
    if words[0] == "ckpt" and not set(cmd) & set("|&;<>$`"):  # a plain ckpt command: run in this process
        code, err, text = _invoke(words[1:], workspace)
    else:
        done = subprocess.run(
            ["bash", "-c", cmd], cwd=workspace, env=env, capture_output=True, text=True, timeout=600
        )
        code, err, text = done.returncode, done.stderr, done.stdout
    want = next((c for prefix, c in EXPECTED_EXIT.items() if example.text.startswith(prefix)), 0)
    assert code == want, (
        f"{example.id}: `{example.text}` exited {code} (documented: {want})\n{err[-2000:]}\n{text[-2000:]}"
    )
    assert "Traceback" not in err, err[-2000:]
    wrong = _bad_plurals(text + err)
    assert not wrong, f"{example.id}: miscounted words in the output: {wrong}"


_PLURAL = re.compile(
    r"(?<![\d.,])1 (steps|checkpoints|tensors|ranks|files|failures|sessions|restarts|causes|errors|problems|"
    r"shards|boundaries|resumes|checks|samples|tokens|events|tags|adapters|layers|experts)\b"
    r"|(?<![\d.,])(?:0|[2-9]|\d\d+) (step|checkpoint|tensor|rank|file|failure|session|restart|cause|error|problem|"
    r"shard|boundary|resume|check|tag|layer|expert)(?=[,.;:)]|$)"
    r"|\w\(s\)",
    re.M,
)


def _bad_plurals(text: str) -> list[str]:
    """'1 steps', '3 checkpoint', 'step(s)': a count and its noun that disagree (or hedge)."""
    return sorted({m.group(0) for m in _PLURAL.finditer(text)})


# -------------------------------------------------------------------------------------------- python blocks

#: (doc, text in the block) -> why the block is not executed here
PY_NOT_RUN: dict[tuple[str, str], str] = {
    (
        "docs/guide.md",
        "mgr.staged()",
    ): "`model(batch).loss` and `ema.copy_into` stand for the user's model and EMA",
    ("docs/run-dir.md", "batch = next(loader)"): (
        "a template: `next(loader)`, `batch.ids`, `saved_and_committed` stand for the user's loop"
    ),
    (
        "docs/run-dir.md",
        "samples=loader.samples",
    ): "a template: `loader.samples`, `ids`, `loss` come from the user's loop",
    ("docs/nxd.md", "nxd.list_tags(root) -> list[TagInfo]"): "an API signature listing, not code",
    ("docs/nxd.md", "nxd.import_tag(tag_dir, dest, *,"): "an API signature listing, not code",
    ("docs/guide.md", "check_continuation(train, steps=40"): (
        "names the user's own module-level train(); check_continuation runs in tests/test_core_continuation.py"
    ),
    ("docs/guide.md", 'local_dir="/local/nvme/ckpt"'): (
        "replicas=1 needs two nodes (refused on one); tests/test_tiers_ranks.py makes the same calls on 4 gloo ranks "
        "as 2 nodes, and `train_step`/`total` stand for the user's loop"
    ),
    ("docs/guide.md", "add_safe_globals([SeedableRandomSampler"): (
        "`accelerator` is the user's prepared Accelerator with a SeedableRandomSampler loader; "
        "tests/test_accelerate_sampler.py makes these calls on a converted folder in a fresh process"
    ),
    ("docs/guide.md", 'accelerator.load_state("gpu/checkpoint_7")'): (
        "`accelerator` is the user's prepared Accelerator; tests/test_accelerate.py calls load_state on converted folders"
    ),
    ("docs/guide.md", 'CkptStateHooks(accelerator, "run/ckpt"'): (
        "`model`, `opt`, `dl`, `sched` and `global_step` stand for the user's; tests/test_accelerate.py runs the hooks "
        "with real accelerate (kill and resume, two gloo ranks)"
    ),
    ("docs/guide.md", 'local_dir="/dev/shm/ckpt"'): (
        "replicas=1 needs two nodes (refused on one); tests/test_tiers_memory.py makes the same calls on 2 gloo ranks "
        "as 2 nodes, and `train_step`/`total` stand for the user's loop"
    ),
    ("docs/guide.md", "from ckpt.integrations.lightning import CkptCheckpointIO"): (
        "`model` and `data` stand for the user's LightningModule and data; tests/test_lightning_plugin.py runs a "
        "Trainer with CkptCheckpointIO and ModelCheckpoint, killed and resumed with ckpt_path="
    ),
    ("docs/verify-resume.md", "def train(c: Continuation)"): (
        "a template around the user's build(); check_continuation runs in tests/test_core_continuation.py"
    ),
}

#: text in a python block -> what the test uses instead; ``s3://bucket/`` is a moto S3 server's bucket (conftest's
#: ``s3`` fixture), reached through ``AWS_ENDPOINT_URL`` as a user's environment points boto at an endpoint
PY_SUBSTITUTE: dict[str, str] = {
    '.safetensors", ...)': '.safetensors", data)',  # storage.md: `...` for the bytes written
    '"runs/x"': '"runs/small-gpu"',
    '"runs/gpu"': '"runs/small-gpu"',
    '"tb/trn"': '"tb_logs/trn"',
}

#: top-level workspace entries a python block reads; its outputs go to its own folder
PY_INPUTS = (
    "runs",
    "run",
    "config.json",
    "hf_model",
    "big",
    "base",
    "peft_adapter",
    "trn",
    "tb_logs",
    "ckpt",
)


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    code: str

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def python_blocks(docs: list[Path] = DOCS) -> list[Block]:
    return [
        Block(str(path.relative_to(ROOT)), first, "\n".join(body))
        for path in docs
        for lang, first, body in _blocks(path)
        if lang == "python"
    ]


PY_BLOCKS = python_blocks()


def _py_not_run(block: Block) -> str | None:
    return next(
        (why for (doc, text), why in PY_NOT_RUN.items() if doc == block.doc and text in block.code), None
    )


def _namespace(ws: Path, folder: Path) -> dict[str, object]:
    """The names the docs' snippets take as given (the user's model, optimizer, loader, ...), real and small."""
    import torch
    from peft import PeftModel
    from torch.utils.data import DataLoader, DistributedSampler
    from torchdata.stateful_dataloader import StatefulDataLoader
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import ckpt
    import ckpt.data
    from ckpt.resume.ledger import tokenizer_id
    from ckpt.storage import Backend

    torch.manual_seed(0)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(ws / "base"), str(ws / "peft_adapter"), is_trainable=True
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ds = [torch.randint(0, 128, (16,)) for _ in range(32)]
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=7)
    loader = StatefulDataLoader(ds, batch_size=4, sampler=sampler)
    tok = _tokenizer()
    return {
        "ckpt": ckpt, "torch": torch, "model": model, "opt": opt, "optimizer": opt, "sched": sched,
        "scheduler": sched, "loader": loader, "ds": ds, "tok": tok, "total": 1000, "step": 500, "epochs": 2,
        "dp_size": 1, "dp_rank": 0, "seed": 7, "per_rank_batch": 4, "path": str(ws / "ckpt" / "step_00001000"),
        "run_dir": folder / "run", "rank": 0, "ws": 1, "tok_id": tokenizer_id(tok),
        "Trainer": Trainer, "args": TrainingArguments(output_dir=str(folder / "trainer"), use_cpu=True, report_to=[]),
        "tmp_path": folder / "tmp", "Backend": Backend, "DistributedSampler": DistributedSampler,
        "StatefulDataLoader": StatefulDataLoader, "DataLoader": DataLoader,
        "cfg": json.loads((ws / "config.json").read_text()),
        "data": b"\x00" * 4096, "manifest": b"{}", "index": b"{}", "offset": 16, "nbytes": 64,
        "make_scheduler": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 50)),
    }  # fmt: skip


def _tokenizer() -> object:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    )


@pytest.mark.parametrize("block", PY_BLOCKS, ids=lambda b: b.id)
def test_documented_python_runs_as_written(
    block: Block,
    workspace: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    why = _py_not_run(block)
    if why is not None:
        pytest.skip(f"not run here: {why}")
    from ckpt.data import adapters

    code = block.code
    for text, replacement in PY_SUBSTITUTE.items():
        code = code.replace(text, replacement)
    extra: dict[str, object] = {}
    if "s3://bucket/" in code:
        s3 = request.getfixturevalue("s3")
        code = code.replace("s3://bucket/", f"s3://{s3.bucket}/")
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
        extra = {"url": s3.endpoint, "options": s3.storage_options}
    for name in PY_INPUTS:
        (tmp_path / name).symlink_to(workspace / name)
    registered = list(adapters._ADAPTERS)
    namespace = {**_namespace(workspace, tmp_path), **extra}
    try:
        with _cwd(tmp_path):
            exec(compile(code, f"{block.doc}:{block.line}", "exec"), namespace)  # noqa: S102 - the doc's example
    finally:
        adapters._ADAPTERS[:] = registered  # an example's ckpt.data.register() must not leak into other tests
        closer = namespace.get("mgr")
        if closer is not None:
            closer.close()


def test_python_tables_name_only_real_blocks() -> None:
    """Every python allow-list entry and substitution still matches a documented block."""
    assert len(PY_BLOCKS) >= 15
    for (doc, text), _why in PY_NOT_RUN.items():
        assert any(b.doc == doc and text in b.code for b in PY_BLOCKS), f"{doc}: {text!r} is no longer there"
    for text in PY_SUBSTITUTE:
        assert any(text in b.code for b in PY_BLOCKS), f"substitution {text!r} is no longer used by the docs"


def inline_commands(docs: list[Path] = DOCS) -> list[Example]:
    """`ckpt CMD --flag ...` written inline in prose and tables (the cheat sheet): their flags must exist."""
    found = []
    for path in docs:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in re.finditer(r"`(ckpt [a-z-]+ [^`]*--[^`]*)`", line):
                found.append(Example(str(path.relative_to(ROOT)), n, m.group(1), synopsis=True))
    return found


@pytest.mark.parametrize("example", inline_commands(), ids=lambda e: e.id)
def test_inline_command_names_only_flags_the_command_has(example: Example) -> None:
    test_synopsis_names_only_flags_the_command_has(example)

"""What a session's ``env`` record says about the machine: one-line summaries and differences between runs.

The ledger's ``session_start`` event records package versions, ``cuda`` (the CUDA version torch was *built*
with, ``torch.version.cuda``), ``dist_backend`` (the ``torch.distributed`` backend when a process group was
up when the ledger was opened), ``world_size`` and any ``extra_env``.  ``ckpt compare`` names each run's
environment with these; ``verify-resume``'s environment check compares the same keys across a resume.

Which device a run trained on is read from evidence of use, never from what is installed: the default
PyPI torch for Linux is a CUDA build, so a CPU/gloo run on a machine without a GPU would otherwise read as
``cuda``.
"""

from __future__ import annotations

from collections.abc import Mapping

from ckpt.resume.model import Run

VERSION_KEYS = (
    "torch",
    "torch_xla",
    "torch_neuronx",
    "neuronx_cc",
    "neuronx_distributed",
    "libneuronxla",
    "cuda",
    "python",
)
"""Versions that change numerics or compiled graphs, in the order people name them."""

NEURON_KEYS = ("torch_xla", "torch_neuronx", "neuronx_cc", "neuronx_distributed", "libneuronxla")

IGNORED_KEYS = frozenset({"hostname", "pid", "tokenizer_id"})
"""Keys that differ between any two processes (or are reported on their own) and say nothing about numerics."""

UNKNOWN_DEVICE = "device not logged"

_DIST_DEVICE = {"nccl": "cuda", "gloo": "cpu", "xla": "xla"}
"""What a ``torch.distributed`` backend says about the device: NCCL runs on CUDA tensors only, gloo is
torch.distributed's CPU backend, ``xla`` is torch-xla's."""

_DIST_NAMES = {
    "torch_xla": "torch-xla",
    "torch_neuronx": "torch-neuronx",
    "neuronx_cc": "neuronx-cc",
    "neuronx_distributed": "neuronx-distributed",
    "libneuronxla": "libneuronxla",
}


def last_env(run: Run) -> dict[str, object]:
    """The environment of the run's last session that logged one: the process whose steps end the curve."""
    for session in reversed(run.sessions):
        if session.env:
            return dict(session.env)
    return {}


def run_tokenizer(run: Run) -> str | None:
    """The tokenizer id of the last session that logged one, or None."""
    ids = [s.env.get("tokenizer_id") for s in run.sessions if s.env.get("tokenizer_id") is not None]
    return str(ids[-1]) if ids else None


def backend(env: Mapping[str, object]) -> str:
    """``neuron``, ``cuda``, ``xla``, ``cpu`` (or an explicit value), or ``device not logged``.

    In order: an explicit ``backend``/``device`` extra (``LedgerWriter(extra_env={"backend": ...})``); Neuron
    compiler/runtime packages, which are installed only on Trainium/Inferentia hosts; the
    ``torch.distributed`` backend the process group used.  The ``cuda`` key is not evidence: it is the CUDA
    version torch was built with, present on every machine with the default Linux wheel, GPU or not.
    """
    for key in ("backend", "device"):
        if env.get(key):
            return str(env[key])
    if any(env.get(k) for k in NEURON_KEYS if k != "torch_xla"):
        return "neuron"
    dist = env.get("dist_backend")
    if isinstance(dist, str) and dist in _DIST_DEVICE:
        return _DIST_DEVICE[dist]
    return UNKNOWN_DEVICE if env else "unknown"


def env_summary(env: Mapping[str, object]) -> str:
    """One line per run, e.g. ``neuron torch 2.9.0 torch-xla 2.9.0 neuronx-cc 2.21`` or ``cuda 12.8 torch
    2.9.0 world 8``: the device and the versions that change numerics, in the order people name them; when
    the device is not known, ``torch 2.9.0 world 2, device not logged``."""
    if not env:
        return "not logged"
    device = backend(env)
    parts = [f"{_DIST_NAMES.get(k, k)} {env[k]}" for k in ("torch", *NEURON_KEYS) if env.get(k)]
    if env.get("world_size") is not None:
        parts.append(f"world {env['world_size']}")
    if device == UNKNOWN_DEVICE:
        return ", ".join([" ".join(parts), device]) if parts else device
    cuda = f" {env['cuda']}" if device == "cuda" and env.get("cuda") else ""
    return " ".join([device + cuda, *parts])


def env_differences(a: Mapping[str, object], b: Mapping[str, object]) -> list[tuple[str, object, object]]:
    """(key, A, B) for every logged setting that differs: versions first, then the rest alphabetically.
    Nothing when either run logged no environment (TensorBoard, CSV): every key would "differ"."""
    if not a or not b:
        return []
    keys = [k for k in VERSION_KEYS if k in a or k in b]
    keys += sorted((set(a) | set(b)) - set(VERSION_KEYS) - IGNORED_KEYS)
    return [(k, a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)]

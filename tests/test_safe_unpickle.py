"""ckpt.safe_unpickle: restricted loading of foreign torch pickles."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from ckpt.errors import CorruptionError, UnsafePickleError
from ckpt.safe_unpickle import TensorReference, load_torch_file

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nxd" / "llama_gqa_h64"
XSER_MODEL = FIX / "nxd_train_tp2_dp2_zero1_xser" / "step_3" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _legacy_torch_file(payload: bytes) -> bytes:
    """Wrap a raw pickle in torch's legacy (non-zip) ``torch.save`` framing so torch.load reaches the payload."""
    sys_info = {
        "protocol_version": 1001,
        "little_endian": True,
        "type_sizes": {"short": 2, "int": 4, "long": 4},
    }
    head = b"".join(pickle.dumps(x, protocol=2) for x in (0x1950A86A20F9469CFC6C, 1001, sys_info))
    return head + payload + pickle.dumps([], protocol=2)


def test_plain_state_dict_loads(tmp_path: Path) -> None:
    sd = {"w": torch.arange(6.0).reshape(2, 3), "n": [1, 2], "s": torch.Size([2, 3])}
    torch.save(sd, tmp_path / "a.pt")
    got = load_torch_file(tmp_path / "a.pt")
    assert torch.equal(got["w"], sd["w"]) and got["n"] == [1, 2] and tuple(got["s"]) == (2, 3)
    with open(tmp_path / "a.pt", "rb") as f:
        assert torch.equal(load_torch_file(f)["w"], sd["w"])


@pytest.mark.parametrize("how", ["torch.save", "pickle.dump"])
def test_malicious_reduce_is_refused_and_not_executed(tmp_path: Path, how: str) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    if how == "torch.save":
        torch.save({"x": _Evil(marker)}, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(_Evil(marker), f, protocol=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnsafePickleError) as ei:
            load_torch_file(path)
    msg = str(ei.value)
    assert "\n" not in msg and str(path) in msg and "system" in msg
    assert not marker.exists()


def test_xser_tensor_reference_maps_to_stand_in() -> None:
    refs = load_torch_file(XSER_MODEL)
    assert list(refs)[0] == "model.embed_tokens.weight"
    assert all(isinstance(r, TensorReference) for r in refs.values())
    assert [r.tid for r in refs.values()] == list(range(len(refs)))
    # the allow-list entry is only active during our loads
    assert not any(
        isinstance(g, tuple) and g[0] is TensorReference for g in torch.serialization.get_safe_globals()
    )


def test_tensor_reference_with_extra_state_is_refused(tmp_path: Path) -> None:
    # GLOBAL torch_xla...TensorReference; NEWOBJ; BUILD {"tid": 0, "evil": 1}
    payload = (
        b"\x80\x02ctorch_xla.utils.serialization\nTensorReference\nq\x00)\x81q\x01}q\x02(X\x03\x00\x00\x00tidq\x03"
        b"K\x00X\x04\x00\x00\x00evilq\x04K\x01ub."
    )
    (tmp_path / "r.pkl").write_bytes(_legacy_torch_file(payload))
    with pytest.raises(UnsafePickleError, match="TensorReference state"):
        load_torch_file(tmp_path / "r.pkl")
    ok = payload.replace(b"X\x04\x00\x00\x00evilq\x04K\x01", b"")
    (tmp_path / "ok.pkl").write_bytes(_legacy_torch_file(ok))
    assert load_torch_file(tmp_path / "ok.pkl") == TensorReference(0)


def test_extra_allowed_maps_by_name_without_import(tmp_path: Path) -> None:
    payload = b"\x80\x02cnot_a_real_module.sub\nThing\nq\x00)\x81q\x01}q\x02X\x01\x00\x00\x00aK\x07sb."
    (tmp_path / "t.pkl").write_bytes(_legacy_torch_file(payload))
    with pytest.raises(UnsafePickleError, match="not_a_real_module.sub.Thing"):
        load_torch_file(tmp_path / "t.pkl")

    class Thing:
        pass

    got = load_torch_file(tmp_path / "t.pkl", {("not_a_real_module.sub", "Thing"): Thing})
    assert isinstance(got, Thing) and got.a == 7
    assert "not_a_real_module" not in sys.modules


def test_truncated_file_is_corruption(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(100)}, tmp_path / "a.pt")
    data = (tmp_path / "a.pt").read_bytes()
    (tmp_path / "b.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptionError, match="b.pt"):
        load_torch_file(tmp_path / "b.pt")


def test_no_torch_xla_import() -> None:
    code = f"""
import sys
sys.modules["torch_xla"] = None  # any import of torch_xla now raises ImportError
from ckpt.safe_unpickle import load_torch_file
refs = load_torch_file({str(XSER_MODEL)!r})
assert len(refs) == 35
assert sys.modules["torch_xla"] is None
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "ok" in out.stdout

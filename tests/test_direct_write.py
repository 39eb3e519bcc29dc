"""Direct I/O from the staging arena (ckpt.format.directwrite): the same file bytes and checksums as the buffered
writer for any header, payload sizes and arena placement; whole congruent blocks go to the disk straight from the
arena; a refused direct write falls back to a buffered one with nothing lost."""

from __future__ import annotations

import io
import mmap
import os
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt.format.directwrite import ALIGN, BOUNCE, enable_direct, new_bounce, write_direct
from ckpt.format.streamwrite import safetensors_header, write_payloads
from ckpt.saving import writer_child
from ckpt.saving.process_writer import ProcessStager

ARENA = 4 * BOUNCE


def _arena() -> mmap.mmap:
    mm = mmap.mmap(-1, ARENA)
    mm[:] = os.urandom(1 << 20) * (ARENA >> 20)
    return mm


MM = _arena()
BOUNCE_BUF = new_bounce()


def layout(
    head_len: int, sizes: list[int], congruent: list[bool], gaps: list[int]
) -> list[tuple[int, int]] | None:
    """Arena spans for payloads of ``sizes``: each congruent with its file offset or shifted off it."""
    spans, pos, f = [], 0, head_len
    for n, c, gap in zip(sizes, congruent, gaps, strict=True):
        p = pos + (f - pos) % ALIGN
        if not c:
            p += 1 + gap % (ALIGN - 1)  # off by 1..ALIGN-1: never congruent
        spans.append((p, n))
        pos, f = p + n, f + n
    return spans if pos <= ARENA else None


def buffered(head: bytes, spans: list[tuple[int, int]]) -> tuple[bytes, list[tuple[int, int, str]], int]:
    out = io.BytesIO()
    placed, size = write_payloads(out, head, [memoryview(MM)[o : o + n] for o, n in spans])
    return out.getvalue(), placed, size


sizes_st = st.lists(
    st.one_of(
        st.integers(0, 3 * ALIGN), st.integers(ALIGN, 3 * BOUNCE // 4), st.sampled_from([4, 2 * ALIGN])
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(
    head_pad=st.integers(0, 3 * ALIGN // 8),
    sizes=sizes_st,
    congruent=st.lists(st.booleans(), min_size=6, max_size=6),
    gaps=st.lists(st.integers(0, 10**6), min_size=6, max_size=6),
)
def test_direct_write_is_byte_for_byte_the_buffered_write(
    tmp_path_factory, head_pad: int, sizes: list[int], congruent: list[bool], gaps: list[int]
) -> None:
    head = b"h" * (8 + 8 * head_pad)
    spans = layout(len(head), sizes, congruent[: len(sizes)], gaps[: len(sizes)])
    if spans is None:
        return
    want, want_placed, want_size = buffered(head, spans)
    path = tmp_path_factory.mktemp("d") / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        assert enable_direct(fd)
        placed, size, stats = write_direct(fd, head, memoryview(MM), spans, BOUNCE_BUF)
    finally:
        os.close(fd)
    assert path.read_bytes() == want and size == want_size == len(want)
    assert placed == want_placed
    assert stats.direct + stats.bounced == size
    # every whole block of a congruent payload went direct; what bounced is the header's block, the blocks that
    # straddle two payloads, and the incongruent payloads
    incongruent = sum(n for (_, n), c in zip(spans, congruent, strict=False) if not c)
    assert stats.bounced <= len(head) + ALIGN * (len(spans) + 1) + incongruent
    assert stats.direct % ALIGN == 0


def _serve(
    tmp_path: Path, arena: memoryview, spans: list[tuple[int, int]], direct: bool
) -> tuple[dict, bytes]:
    entries = [(f"t{i}@0", "U8", (n,), n) for i, (_, n) in enumerate(spans)]
    req = {
        "root": str(tmp_path),
        "fname": f"f{len(os.listdir(tmp_path))}",
        "entries": entries,
        "spans": spans,
        "metadata": {"format": "ckpt"},
        "direct": direct,
    }
    reply = writer_child.serve(arena, req)
    return reply, (tmp_path / req["fname"]).read_bytes()


def test_a_refused_direct_write_is_rewritten_buffered(tmp_path: Path) -> None:
    # congruent by offset, but the view starts one byte past a page: the kernel refuses every direct write from it
    shifted = memoryview(MM)[1:]
    sizes = [3 * ALIGN + 5, 5 * ALIGN]
    head_len = len(
        safetensors_header([(f"t{i}@0", "U8", (n,), n) for i, n in enumerate(sizes)], {"format": "ckpt"})
    )
    spans = layout(head_len, sizes, [True, True], [0, 0])
    assert spans is not None
    good, good_bytes = _serve(tmp_path, memoryview(MM)[ALIGN:], spans, direct=True)  # page-aligned: direct
    assert good["io"]["direct"] > 0 and good["io"]["buffered"] == 0
    refused, refused_bytes = _serve(tmp_path, shifted, spans, direct=True)
    assert refused["io"] == {"direct": 0, "bounced": 0, "buffered": refused["size"]}
    plain, plain_bytes = _serve(tmp_path, shifted, spans, direct=False)
    assert refused_bytes == plain_bytes and refused["placed"] == plain["placed"]
    assert sorted(os.listdir(tmp_path)) == ["f0", "f1", "f2"]  # no temp file left behind


def test_a_save_writes_its_data_file_straight_from_the_arena(tmp_path: Path) -> None:
    """A model with odd-sized tensors and mixed dtypes (the layout rule's hard cases): nearly every byte goes to the
    disk by direct I/O, and the checkpoint restores bit-exact."""
    import ckpt
    from ckpt.saving.checkpointer import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 257), torch.nn.LayerNorm(257), torch.nn.Linear(257, 77))
    model[2].to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    model[0](torch.randn(2, 300)).square().mean().backward()
    opt.step()
    stager = ProcessStager()
    ck = Checkpointer(async_save=True, stager=stager)
    ck.save(str(tmp_path / "s"), step=1, model=model, optimizer=opt).result()
    total = sum(f.stat().st_size for f in (tmp_path / "s").iterdir() if f.name.endswith(".safetensors"))
    assert stager.io["buffered"] == 0 and stager.io["direct"] + stager.io["bounced"] == total
    assert stager.io["direct"] >= 0.9 * total, stager.io
    ck.close()
    fresh = torch.nn.Sequential(torch.nn.Linear(300, 257), torch.nn.LayerNorm(257), torch.nn.Linear(257, 77))
    fresh[2].to(torch.bfloat16)
    ckpt.restore(str(tmp_path / "s"), model=fresh, rng=False)
    for (k, v), w in zip(fresh.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(v, w), k

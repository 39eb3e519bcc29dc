"""The global data position: where the whole data-parallel job stands in its epoch, independent of the DP size.

Each rank reports a :class:`RankPosition` (how many samples *it* consumed in the current epoch, counted on batches
handed to the training loop, never on what a prefetcher read ahead); rank 0 merges them into one
:class:`DataPosition`, the manifest's ``data_position`` (spec: docs/format.md, "Data position").  What makes it
independent of the DP size: ``samples`` is an index into the *epoch's global sample order* (the saved sampler's
order, which :mod:`ckpt.data.sampler` can recompute from ``order``), so a job on any number of ranks can continue
at exactly that index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ManifestError, StateMismatchError

JSON = Any


@dataclass(frozen=True)
class RankPosition:
    """One rank's place in the current epoch, as its adapter saw it at the save.

    ``base`` is the global index the rank's current iteration started from (0, or the position a re-split
    resume started at); the rank consumed ``consumed`` samples of that iteration; ``order`` describes the
    global order (kind-specific, e.g. a DistributedSampler's seed, shuffle, dataset length, drop_last).
    ``replica``/``replicas`` are the rank's data-parallel index and the DP size as the loader sees them (a
    DistributedSampler's ``rank``/``num_replicas``): with tensor or pipeline parallelism several processes read
    the same replica's data and count once.  None: every process is its own replica.
    """

    adapter: str
    epoch: int
    base: int
    consumed: int
    batch_size: int | None
    order: dict[str, JSON] | None
    replica: int | None = None
    replicas: int | None = None

    def to_json(self) -> dict[str, JSON]:
        return {
            "adapter": self.adapter,
            "epoch": self.epoch,
            "base": self.base,
            "consumed": self.consumed,
            "batch_size": self.batch_size,
            "order": self.order,
            "replica": self.replica,
            "replicas": self.replicas,
        }

    @staticmethod
    def from_json(doc: dict[str, JSON]) -> RankPosition:
        return RankPosition(
            doc["adapter"],
            doc["epoch"],
            doc["base"],
            doc["consumed"],
            doc["batch_size"],
            doc["order"],
            doc.get("replica"),
            doc.get("replicas"),
        )


@dataclass(frozen=True)
class DataPosition:
    """The manifest's ``data_position``: the global position plus each rank's share of it.

    ``samples`` is the next global sample index of epoch ``epoch`` (samples consumed so far in it, by all ranks
    together); ``prefix`` is false when the ranks had consumed different numbers of samples, so that the consumed
    samples are not a prefix of the global order and the position cannot be re-split (restoring on the same DP
    size still can).  ``samples_total`` and ``tokens`` are the caller's ``progress`` counters (all epochs).
    """

    adapter: str
    dp: int
    epoch: int
    samples: int
    per_rank: tuple[int, ...]
    prefix: bool
    global_batch: int | None
    order: dict[str, JSON] | None
    samples_total: int | None = None
    tokens: int | None = None

    def to_json(self) -> dict[str, JSON]:
        return {
            "adapter": self.adapter,
            "dp": self.dp,
            "epoch": self.epoch,
            "samples": self.samples,
            "per_rank": list(self.per_rank),
            "prefix": self.prefix,
            "global_batch": self.global_batch,
            "order": self.order,
            "samples_total": self.samples_total,
            "tokens": self.tokens,
        }

    def resume_point(self, rank: int, world: int, where: str, unit: str, sequence: str) -> tuple[int, int]:
        """Where live rank ``rank`` of ``world`` continues: ``(start, skip)`` = the global index the resumed epoch
        starts from and how many of this rank's share from there it already had.

        A prefix position re-splits over any DP size (every rank starts fresh from the global index).  Ranks that
        stood at different counts continue their own shares where each stopped, which needs the same DP size; on
        another one nothing exact is possible and it is refused (``unit``/``sequence`` name what the adapter
        counts: "samples" of the epoch's "order", "examples" of its "stream")."""
        if self.prefix:
            return self.samples, 0
        if world == self.dp:
            return self.samples - sum(self.per_rank), self.per_rank[rank]
        raise StateMismatchError(
            f"{where}: the {self.dp} saving ranks had consumed different numbers of {unit} "
            f"{list(self.per_rank)}, so the consumed {unit} are not a prefix of the epoch's {sequence} and "
            f"cannot be re-split over {world} ranks (save at an optimizer-step boundary)"
        )

    @staticmethod
    def from_json(doc: Any, source: str = "manifest") -> DataPosition:
        """Validate and parse a manifest's ``data_position`` (ManifestError naming the field otherwise)."""
        where = f"{source}: data_position"
        if not isinstance(doc, dict):
            raise ManifestError(f"{where}: expected an object")

        def count(key: str, optional: bool = False) -> int | None:
            v = doc.get(key)
            if v is None and optional:
                return None
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ManifestError(f"{where}.{key}: expected a non-negative integer, got {v!r}")
            return v

        adapter = doc.get("adapter")
        if not isinstance(adapter, str) or not adapter:
            raise ManifestError(f"{where}.adapter: expected a non-empty string, got {adapter!r}")
        per_rank = doc.get("per_rank")
        if not isinstance(per_rank, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in per_rank
        ):
            raise ManifestError(f"{where}.per_rank: expected a list of non-negative integers")
        dp = count("dp")
        assert dp is not None
        if len(per_rank) != dp:
            raise ManifestError(f"{where}.per_rank: {len(per_rank)} entries for dp={dp}")
        prefix = doc.get("prefix")
        if not isinstance(prefix, bool):
            raise ManifestError(f"{where}.prefix: expected true or false, got {prefix!r}")
        order = doc.get("order")
        if order is not None and not isinstance(order, dict):
            raise ManifestError(f"{where}.order: expected an object or null")
        return DataPosition(
            adapter=adapter,
            dp=dp,
            epoch=count("epoch") or 0,
            samples=count("samples") or 0,
            per_rank=tuple(per_rank),
            prefix=prefix,
            global_batch=count("global_batch", True),
            order=order,
            samples_total=count("samples_total", True),
            tokens=count("tokens", True),
        )


def merge(ranks: list[RankPosition | None], progress: dict[str, JSON]) -> DataPosition | None:
    """Rank 0's merge of every process's position (in rank order) into the global one.

    None when no rank reported a position (a loader no adapter knows: its per-rank state is still saved).  The
    ranks must agree on adapter, epoch, base and order: they iterate one global order in lockstep.  Processes
    that read the same replica (TP/PP peers) must agree and count once.  Where any of this fails, the position
    is recorded as not re-splittable rather than guessed (``prefix`` false, ``adapter`` ``"mixed"`` when they
    disagree), and restoring on another DP size refuses.
    """
    if not ranks or all(r is None for r in ranks):
        return None
    present = [r for r in ranks if r is not None]
    first = present[0]
    consistent = len(present) == len(ranks) and all(
        (r.adapter, r.epoch, r.base, r.order, r.replicas)
        == (first.adapter, first.epoch, first.base, first.order, first.replicas)
        for r in present
    )
    replicas: list[RankPosition | None] = list(ranks)
    if consistent and first.replicas is not None and all(r.replica is not None for r in present):
        by_replica: dict[int, RankPosition] = {}
        for r in present:
            seen = by_replica.setdefault(r.replica, r)  # type: ignore[arg-type]
            consistent = consistent and (seen.consumed, seen.batch_size) == (r.consumed, r.batch_size)
        consistent = consistent and sorted(by_replica) == list(range(first.replicas))
        if consistent:
            replicas = [by_replica[i] for i in range(first.replicas)]
    per_rank = tuple(r.consumed if r is not None else 0 for r in replicas)
    sizes = [r.batch_size for r in replicas if r is not None]
    complete = len(sizes) == len(replicas) and all(s is not None for s in sizes)
    global_batch = sum(s for s in sizes if s is not None) if complete else None

    def counter(key: str) -> int | None:
        v = progress.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

    return DataPosition(
        adapter=first.adapter if consistent else "mixed",
        dp=len(replicas),
        epoch=first.epoch,
        samples=first.base + sum(per_rank),
        per_rank=per_rank,
        prefix=consistent and len(set(per_rank)) == 1,
        global_batch=global_batch,
        order=first.order if consistent else None,
        samples_total=counter("samples"),
        tokens=counter("tokens"),
    )


def describe(doc: dict[str, JSON]) -> str:
    """One line for ``ckpt inspect``: where the job stood and whether another DP size can continue it."""
    p = DataPosition.from_json(doc)
    batch = f", global batch {p.global_batch}" if p.global_batch else ""
    total = f", {p.samples_total} samples in all" if p.samples_total is not None else ""
    how = (
        "continues on any DP size"
        if p.prefix
        else f"ranks stood at different counts {list(p.per_rank)}: continues on {p.dp} ranks only"
    )
    return (
        f"epoch {p.epoch}, next global sample {p.samples} ({p.adapter}, {p.dp} DP ranks{batch}{total}); {how}"
    )

"""``extra.nxd``: what a Neuron-layout manifest records about its layout, as one typed object.

The manifest's ``layout`` says the parallel sizes (tp, pp, dp, ep); NxD's files and runtime do not say the rest
(the rule set, KV replication and head order, fused QKV, virtual PP, the model config), so the Neuron saver, the
NxD import and every conversion record it here and every reader rebuilds the layout from it
(:meth:`NxdRecord.spec`).  Spec: docs/format.md, "Neuron (NxD) layout".  Unknown keys are refused: a newer writer's
field that this version cannot honour must not be dropped silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckpt.errors import LayoutError, ManifestError
from ckpt.layouts.families import get_rule_set
from ckpt.layouts.rules import DEFAULT_RULE_SET
from ckpt.layouts.spec import LayoutSpec, ModelDims, NxdFlags

_FLAG_KEYS = ("kv_size_multiplier", "hw", "fuse_qkv", "qkv_linear", "virtual_pp")
_KEYS = ("rule_set", *_FLAG_KEYS, "config", "pp_ranks", "source", "optimizer_extra", "replicated")


@dataclass(frozen=True)
class NxdRecord:
    """The typed form of ``extra.nxd``.

    ``rule_set`` names the rules that partitioned tensors without NxD's runtime attributes (None: such tensors were
    treated as replicated); ``config`` is the Hugging Face ``config.json`` dict (None when unknown); ``pp_ranks`` maps each tensor to the PP
    ranks holding it (written when pp > 1, so a tag can be rebuilt without a config); ``source`` describes an
    imported NxD tag (``format``, ``tag``, ``status``, ``xser``, ``zero1``, ``legacy``); ``optimizer_extra`` keeps
    (encoded) top-level keys of NxD optimizer dicts that ckpt does not interpret, so an export writes them back;
    ``replicated`` are the globs the user declared replicated for tensors the rule set does not know
    (``--replicated``), kept so that a later conversion of this checkpoint knows them too.
    """

    rule_set: str | None = DEFAULT_RULE_SET
    kv_size_multiplier: int = 1
    hw: str = "trn1"
    fuse_qkv: bool = False
    qkv_linear: bool = False
    virtual_pp: int = 1
    config: dict[str, Any] | None = None
    pp_ranks: dict[str, list[int]] | None = None
    source: dict[str, Any] | None = None
    optimizer_extra: Any = None
    replicated: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        flags: NxdFlags,
        *,
        rule_set: str | None = DEFAULT_RULE_SET,
        config: Mapping[str, Any] | None = None,
        **rest: Any,
    ) -> NxdRecord:
        """The record of a layout with ``flags`` (sizes go to the manifest's ``layout``, not here)."""
        return cls(
            rule_set=rule_set,
            **{k: getattr(flags, k) for k in _FLAG_KEYS},
            config=dict(config) if config is not None else None,
            **rest,
        )

    def to_extra(self) -> dict[str, Any]:
        """The JSON object stored as ``extra.nxd`` (optional members only when set)."""
        from ckpt.format import treecodec

        out: dict[str, Any] = {"rule_set": self.rule_set}
        out.update({k: getattr(self, k) for k in _FLAG_KEYS})
        out["config"] = treecodec.encode(self.config, "extra.nxd.config") if self.config is not None else None
        if self.pp_ranks is not None:
            out["pp_ranks"] = {n: list(r) for n, r in self.pp_ranks.items()}
        if self.source is not None:
            out["source"] = dict(self.source)
        if self.optimizer_extra is not None:
            out["optimizer_extra"] = self.optimizer_extra
        if self.replicated:
            out["replicated"] = list(self.replicated)
        return out

    @classmethod
    def from_extra(cls, value: Any, where: str) -> NxdRecord:
        """Parse ``extra.nxd`` of the manifest at ``where``; a malformed or unknown member is a ManifestError."""
        from ckpt.format import treecodec

        if not isinstance(value, Mapping):
            raise ManifestError(f"{where}: extra.nxd is {type(value).__name__}, expected an object")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ManifestError(
                f"{where}: extra.nxd has unknown member {unknown[0]!r} (written by a newer ckpt?); "
                f"known: {', '.join(_KEYS)}"
            )
        ints = {k: value.get(k, 1) for k in ("kv_size_multiplier", "virtual_pp")}
        bools = {k: value.get(k, False) for k in ("fuse_qkv", "qkv_linear")}
        for k, v in ints.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ManifestError(f"{where}: extra.nxd.{k} is {v!r}, expected a positive integer")
        for k, v in bools.items():
            if not isinstance(v, bool):
                raise ManifestError(f"{where}: extra.nxd.{k} is {v!r}, expected true or false")
        rule_set = value.get("rule_set", DEFAULT_RULE_SET)
        hw = value.get("hw", "trn1")
        if not (rule_set is None or isinstance(rule_set, str)) or not isinstance(hw, str):
            raise ManifestError(
                f"{where}: extra.nxd.rule_set must be a string or null, extra.nxd.hw a string"
            )
        try:
            if rule_set is not None:
                get_rule_set(rule_set)
        except LayoutError as e:
            raise ManifestError(f"{where}: extra.nxd: {e}") from None
        config = value.get("config")
        if config is not None:
            config = treecodec.decode(config)
            if not isinstance(config, dict):
                raise ManifestError(
                    f"{where}: extra.nxd.config is {type(config).__name__}, expected an object"
                )
        pp_ranks = value.get("pp_ranks")
        if pp_ranks is not None:
            ok = isinstance(pp_ranks, Mapping) and all(
                isinstance(r, list) and all(isinstance(p, int) and p >= 0 for p in r)
                for r in pp_ranks.values()
            )
            if not ok:
                raise ManifestError(f"{where}: extra.nxd.pp_ranks must map tensor names to lists of PP ranks")
            pp_ranks = {str(n): list(r) for n, r in pp_ranks.items()}
        source = value.get("source")
        if source is not None and not isinstance(source, Mapping):
            raise ManifestError(f"{where}: extra.nxd.source must be an object")
        replicated = value.get("replicated", [])
        if not isinstance(replicated, list) or not all(isinstance(g, str) and g for g in replicated):
            raise ManifestError(f"{where}: extra.nxd.replicated must be a list of non-empty globs")
        return cls(
            rule_set=rule_set,
            hw=hw,
            config=config,
            pp_ranks=pp_ranks,
            source=dict(source) if source is not None else None,
            optimizer_extra=value.get("optimizer_extra"),
            replicated=tuple(replicated),
            **ints,
            **bools,
        )

    def flags(self, *, tp: int, pp: int, dp: int = 1) -> NxdFlags:
        """The full flags of a layout of these sizes (``hw`` is checked by :class:`NxdFlags` users)."""
        return NxdFlags(tp=tp, pp=pp, dp=dp, **{k: getattr(self, k) for k in _FLAG_KEYS})  # type: ignore[arg-type]

    def spec(
        self, *, tp: int, pp: int, dp: int = 1, config: Mapping[str, Any] | None = None, where: str = ""
    ) -> LayoutSpec:
        """The :class:`LayoutSpec` this record describes for the given sizes; ``config`` overrides the recorded one.

        Needs the model config (NxD files do not record it): without one, a one-line LayoutError says to pass it.
        """
        cfg = config if config is not None else self.config
        if not cfg:
            raise LayoutError(
                f"{where}: the checkpoint does not record the model config; pass --config config.json"
            )
        return LayoutSpec.of(
            ModelDims.from_hf_config(cfg),
            self.flags(tp=tp, pp=pp, dp=dp),
            rule_set=self.rule_set,
            replicated=self.replicated,
        )


__all__ = ["NxdRecord"]

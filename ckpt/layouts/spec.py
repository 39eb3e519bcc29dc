"""What a parallel layout request is: model dimensions plus NxD parallel flags, validated up front.

Every impossible combination is rejected here, before any tensor is touched, with a one-line
``LayoutError`` that names the flag and what to change.  The rest of the layout engine may then assume
that every division it does is exact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ckpt.errors import LayoutError
from ckpt.layouts.families import FAMILIES, Family, get_family, rules_with, supported
from ckpt.layouts.rules import Rule

Hardware = Literal["trn1", "trn2"]

#: HF ``model_type`` values ckpt can lay out: one module each under ``ckpt/layouts/families/``.
SUPPORTED_MODEL_TYPES = supported()


def _model_type(config: Mapping[str, Any]) -> str:
    """The config's ``model_type``; a config without one is refused (it decides the tensor names and rules)."""
    mt = config.get("model_type")
    if not isinstance(mt, str) or not mt:
        raise LayoutError(
            "config.json has no model_type, which decides the layout rules; pass --model-type "
            f"({'|'.join(SUPPORTED_MODEL_TYPES)}) if the model is one of them (library: ConvertOptions(model_type=))"
        )
    return mt


@dataclass(frozen=True)
class ModelDims:
    """The few numbers of a decoder-only model that decide every tensor's shape and split."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    intermediate: int
    model_type: str = "llama"
    tie_word_embeddings: bool = False
    experts: int = 0
    """Number of MoE experts (0: a dense model); ``intermediate`` is then each expert's MLP width."""

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelDims:
        """Read dims from a Hugging Face ``config.json`` dict.

        ``head_dim`` is taken from the config when present (Mistral-Nemo, Qwen3 style models set it
        independently of ``hidden_size``); otherwise it is ``hidden_size // num_attention_heads``.  An MoE family
        reads its expert count and expert width from the keys its module names; settings a family cannot lay out
        are refused here.
        """
        model_type = _model_type(config)
        family = FAMILIES.get(model_type)
        experts = family.experts if family is not None else None
        if family is not None and family.check_config is not None:
            problem = family.check_config(config)
            if problem:
                raise LayoutError(f"config.json ({model_type}): {problem}")
        inter_key = experts.intermediate_key if experts is not None else "intermediate_size"
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            dims = cls(
                hidden=hidden,
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                layers=int(config["num_hidden_layers"]),
                vocab=int(config["vocab_size"]),
                intermediate=int(config[inter_key]),
                model_type=model_type,
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                experts=experts.count(config) if experts is not None else 0,
            )
        except KeyError as e:
            raise LayoutError(
                f"config.json lacks {e.args[0]!r}, needed to plan the layout; pass --config with the model's "
                "complete Hugging Face config.json"
            ) from None
        return dims

    @property
    def q_rows(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def family(self) -> Family:
        """The model family of ``model_type`` (``LayoutError`` listing the supported ones if there is none)."""
        return get_family(self.model_type)

    def hf_shapes(self, *, qkv_bias: bool | None = None) -> dict[str, tuple[int, ...]]:
        """Every tensor of the Hugging Face model with these dims, name -> shape, in ``save_pretrained`` key order
        within a layer as ``state_dict`` gives it (``qkv_bias``: q/k/v biases, default the family's; a tied
        ``lm_head`` is omitted)."""
        family = self.family
        bias = family.qkv_bias if qkv_bias is None else qkv_bias
        h = self.hidden
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}"
            for proj, rows in (("q", self.q_rows), ("k", self.kv_rows), ("v", self.kv_rows)):
                out[f"{p}.self_attn.{proj}_proj.weight"] = (rows, h)
                if bias:
                    out[f"{p}.self_attn.{proj}_proj.bias"] = (rows,)
            out[f"{p}.self_attn.o_proj.weight"] = (h, self.q_rows)
            if family.qk_norm:
                out[f"{p}.self_attn.q_norm.weight"] = (self.head_dim,)
                out[f"{p}.self_attn.k_norm.weight"] = (self.head_dim,)
            e = family.experts
            if e is None:
                out |= {
                    f"{p}.mlp.gate_proj.weight": (self.intermediate, h),
                    f"{p}.mlp.up_proj.weight": (self.intermediate, h),
                    f"{p}.mlp.down_proj.weight": (h, self.intermediate),
                }
            else:
                out[f"{p}.{e.block}gate.weight"] = (self.experts, h)
                for j in range(self.experts):
                    q = f"{p}.{e.block}experts.{j}"
                    out[f"{q}.{e.gate}.weight"] = (self.intermediate, h)
                    out[f"{q}.{e.up}.weight"] = (self.intermediate, h)
                    out[f"{q}.{e.down}.weight"] = (h, self.intermediate)
            out[f"{p}.input_layernorm.weight"] = (h,)
            out[f"{p}.post_attention_layernorm.weight"] = (h,)
        out["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab, h)
        return out


@dataclass(frozen=True)
class NxdFlags:
    """The parallel flags of an NxD layout: everything about it but the model.

    ``kv_size_multiplier`` is NxD's ``kv_shared_group_size``: how many TP ranks hold a copy of each KV head.
    ``qkv_linear`` selects NxD's ``GQAQKVColumnParallelLinear`` (names ``qkv_proj.weight_q|k|v``);
    ``fuse_qkv`` stores one ``weight_qkv`` per rank (or, for MHA without ``qkv_linear``, the stride-3
    ``qkv_proj.weight``).  ``hw`` decides how KV copies are laid over ranks (see ``gqa.py``).  ``dp`` only
    shards ZeRO-1 optimizer state; it never moves a model tensor.  ``ep`` (expert parallelism, MoE families
    only) gives expert-parallel rank ``k`` experts ``[k*E/ep, (k+1)*E/ep)``; every other tensor is the same on
    every EP rank.
    """

    tp: int = 1
    pp: int = 1
    virtual_pp: int = 1
    dp: int = 1
    kv_size_multiplier: int = 1
    hw: Hardware = "trn1"
    fuse_qkv: bool = False
    qkv_linear: bool = False
    ep: int = 1

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The flag names, in declaration order (what options and records list)."""
        return tuple(f.name for f in fields(NxdFlags))

    def flags(self) -> NxdFlags:
        """Just the flags (drops the model of a :class:`LayoutSpec`)."""
        return NxdFlags(**{n: getattr(self, n) for n in NxdFlags.names()})

    def model_layout_equal(self, other: NxdFlags) -> bool:
        """True when both place every model tensor identically (they may differ in ``dp`` only)."""
        return all(getattr(self, n) == getattr(other, n) for n in NxdFlags.names() if n != "dp")


@dataclass(frozen=True)
class LayoutSpec(NxdFlags):
    """An NxD parallel layout of one model: :class:`NxdFlags` plus the model's dimensions (keyword ``model``).

    ``rule_set`` names the rules that split tensors over TP ranks (default: the model family's); ``replicated`` are
    the user's globs for tensors
    the rule set does not know that are replicated on every rank (``--replicated``); any other unknown name is
    refused when a plan is made.
    """

    model: ModelDims = field(kw_only=True)
    rule_set: str = field(default="", kw_only=True)
    replicated: tuple[str, ...] = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        validate(self)
        if not self.rule_set:  # the family's own rules (validate refused an unknown family)
            object.__setattr__(self, "rule_set", self.model.family.rule_set)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], **flags: Any) -> LayoutSpec:
        """Build a spec from an HF config dict and the parallel flags (``tp=``, ``pp=``, ...)."""
        return cls(model=ModelDims.from_hf_config(config), **flags)

    @classmethod
    def of(
        cls,
        model: ModelDims,
        flags: NxdFlags,
        *,
        rule_set: str | None = None,
        replicated: tuple[str, ...] | list[str] = (),
    ) -> LayoutSpec:
        return cls(
            model=model,
            rule_set=rule_set or "",
            replicated=tuple(replicated),
            **{n: getattr(flags, n) for n in NxdFlags.names()},
        )

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The rule set's rules, then the declared replicated globs."""
        return rules_with(self.rule_set, self.replicated)

    @property
    def family(self) -> Family:
        """The model family (validated at construction)."""
        return self.model.family

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_pp

    @property
    def kv_slots(self) -> int:
        """Number of KV head slots over all TP ranks after replication."""
        return self.model.kv_heads * self.kv_size_multiplier

    @property
    def ranks(self) -> tuple[tuple[int, int], ...]:
        """All ``(tp, pp)`` ranks, TP-major like NxD's file naming loop."""
        return tuple((t, p) for t in range(self.tp) for p in range(self.pp))


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LayoutError(f"{name} {value!r} must be a positive integer")


def validate(spec: LayoutSpec) -> None:
    """Raise ``LayoutError`` for a spec NxD cannot run (or that we cannot map without loss)."""
    m = spec.model
    for flag, value in (
        ("--tp", spec.tp),
        ("--pp", spec.pp),
        ("--virtual-pp", spec.virtual_pp),
        ("--dp", spec.dp),
        ("--kv-size-multiplier", spec.kv_size_multiplier),
        ("--ep", spec.ep),
    ):
        _positive(flag, value)
    for name, value in (
        ("hidden_size", m.hidden),
        ("num_attention_heads", m.heads),
        ("num_key_value_heads", m.kv_heads),
        ("head_dim", m.head_dim),
        ("num_hidden_layers", m.layers),
        ("vocab_size", m.vocab),
        ("intermediate_size", m.intermediate),
    ):
        _positive(f"config {name}", value)
    family = m.family  # refuses an unknown model_type, listing the supported ones
    if family.experts is None:
        if spec.ep != 1:
            raise LayoutError(
                f"--ep {spec.ep} needs an MoE model; model_type {m.model_type!r} has no experts"
            )
    else:
        _positive(f"config {family.experts.count_key}", m.experts)
        if m.experts % spec.ep:
            raise LayoutError(
                f"--ep {spec.ep} does not divide {family.experts.count_key}={m.experts}; change --ep"
            )
    if spec.hw not in ("trn1", "trn2"):
        raise LayoutError(f"--hw {spec.hw!r} must be trn1 or trn2")
    if m.heads % m.kv_heads:
        raise LayoutError(
            f"config num_attention_heads={m.heads} is not a multiple of num_key_value_heads={m.kv_heads}"
        )
    tp, mult = spec.tp, spec.kv_size_multiplier
    if m.vocab % tp:
        raise LayoutError(
            f"--tp {tp} does not divide vocab_size={m.vocab}; pad the vocabulary or change --tp"
        )
    if m.intermediate % tp:
        key = family.experts.intermediate_key if family.experts is not None else "intermediate_size"
        raise LayoutError(f"--tp {tp} does not divide {key}={m.intermediate}; change --tp")
    if m.heads % tp:
        raise LayoutError(f"--tp {tp} does not divide num_attention_heads={m.heads}; change --tp")
    if not spec.qkv_linear:
        if mult != 1:
            raise LayoutError(
                f"--kv-size-multiplier {mult} needs --qkv-linear (KV replication lives in qkv_proj)"
            )
        if m.kv_heads % tp:
            raise LayoutError(
                f"--tp {tp} does not divide num_key_value_heads={m.kv_heads}; "
                f"use --qkv-linear with --kv-size-multiplier {_suggest_mult(m.kv_heads, tp)}"
            )
        if spec.fuse_qkv and m.heads != m.kv_heads:
            raise LayoutError(
                "--fuse-qkv with GQA (num_key_value_heads < num_attention_heads) needs --qkv-linear"
            )
    else:
        if spec.kv_slots % tp:
            raise LayoutError(
                f"--tp {tp} does not divide num_key_value_heads*kv_size_multiplier={spec.kv_slots}; "
                f"use --kv-size-multiplier {_suggest_mult(m.kv_heads, tp)} or change --tp"
            )
        if tp % mult:
            raise LayoutError(f"--kv-size-multiplier {mult} does not divide --tp {tp} (NxD requires it)")
        group = m.heads // m.kv_heads
        if group % mult:
            raise LayoutError(
                f"--kv-size-multiplier {mult} does not divide num_attention_heads/num_key_value_heads={group}; "
                "each KV copy needs a whole share of its query heads"
            )
        if spec.hw == "trn2" and mult > 1 and spec.kv_slots != tp:
            raise LayoutError(
                f"--hw trn2 with --kv-size-multiplier {mult} needs num_key_value_heads*kv_size_multiplier="
                f"{spec.kv_slots} == --tp {tp} (NxD trn2 kv groups are adjacent ranks holding one KV head); "
                f"use --kv-size-multiplier {_suggest_mult(m.kv_heads, tp)}"
            )
    if m.tie_word_embeddings and spec.pp > 1:
        raise LayoutError(
            f"config tie_word_embeddings with --pp {spec.pp} is not supported: NxD then keeps the tied embedding on "
            "the first and last stages, a layout this converter does not map; use --pp 1 or untie the weights"
        )
    if m.layers < spec.num_stages:
        raise LayoutError(
            f"--pp {spec.pp} x --virtual-pp {spec.virtual_pp} = {spec.num_stages} stages exceed "
            f"num_hidden_layers={m.layers}; lower --pp or --virtual-pp"
        )


def _suggest_mult(kv_heads: int, tp: int) -> int:
    """Smallest multiplier making ``kv_heads * mult`` a multiple of ``tp`` (NxD's usual choice: ``tp / kv``)."""
    for mult in range(1, tp + 1):
        if (kv_heads * mult) % tp == 0:
            return mult
    return tp

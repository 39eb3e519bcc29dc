"""A save walks the model's parameters once (``ckpt.state.training.one_walk``) and still names every tensor as the
separate walks did: tied parameters, shared submodules, frozen/trainable splits, and models edited between saves."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpt
from ckpt.state import adapters
from ckpt.state.training import (
    all_named_parameters,
    model_tensors,
    named_parameters,
    one_walk,
    param_names_in_optimizer_order,
)


class Tied(torch.nn.Module):
    """Llama-style tied embeddings plus a block used at two places (its parameters under two names each)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        shared = torch.nn.Linear(4, 4)
        self.first = shared
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), shared])
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * self.scale
        for layer in (self.first, *self.layers):
            x = layer(x)
        return self.head(x)


@st.composite
def module_graphs(draw: st.DrawFn) -> torch.nn.Module:
    """Random trees of Linear/Sequential modules in which some modules and some weights are shared, and some
    parameters frozen."""
    pool: list[torch.nn.Module] = []

    def node(depth: int) -> torch.nn.Module:
        if pool and draw(st.booleans()) and draw(st.booleans()):
            return draw(st.sampled_from(pool))  # a module used twice
        if depth == 0 or draw(st.booleans()):
            m: torch.nn.Module = torch.nn.Linear(2, 2, bias=draw(st.booleans()))
        else:
            m = torch.nn.Sequential(*[node(depth - 1) for _ in range(draw(st.integers(1, 3)))])
        pool.append(m)
        return m

    root = torch.nn.Sequential(*[node(3) for _ in range(draw(st.integers(1, 4)))])
    linears = [m for m in root.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:
        if draw(st.booleans()) and len(linears) > 1:
            other = draw(st.sampled_from(linears))
            m.weight = other.weight  # tied weights
        if draw(st.booleans()):
            m.weight.requires_grad_(False)
    return root


@settings(max_examples=60, deadline=None)
@given(module_graphs())
def test_one_walk_gives_what_torch_walks_give(model: torch.nn.Module) -> None:
    with one_walk(model):
        inside_unique = named_parameters(model)
        inside_all = all_named_parameters(model)
        inside_tensors = [(n.name, n.role) for n in model_tensors(model)]
    assert [(n, id(p)) for n, p in inside_unique] == [(n, id(p)) for n, p in model.named_parameters()]
    assert [(n, id(p)) for n, p in inside_all] == [
        (n, id(p)) for n, p in model.named_parameters(remove_duplicate=False)
    ]
    assert inside_tensors == [(n.name, n.role) for n in model_tensors(model)]


def test_tied_and_shared_parameters_keep_their_names_and_roles() -> None:
    model = Tied()
    opt = torch.optim.Adam(model.parameters())
    for p in model.first.parameters():
        p.requires_grad_(False)
    outside = (
        param_names_in_optimizer_order(opt, model),
        list(adapters.trainable(model)),
        list(adapters.frozen(model)),
        [(n.name, n.role) for n in model_tensors(model)],
    )
    with one_walk(model):
        inside = (
            param_names_in_optimizer_order(opt, model),
            list(adapters.trainable(model)),
            list(adapters.frozen(model)),
            [(n.name, n.role) for n in model_tensors(model)],
        )
    assert inside == outside
    # the optimizer names a tied parameter by its last name (remove_duplicate=False), the model by its first
    assert "head.weight" in inside[0] and "embed.weight" not in inside[0]
    assert "embed.weight" in inside[1]
    assert ("scale", "buffer") in inside[3]


class Counting(torch.nn.Module):
    """Counts calls of ``named_parameters`` on the top module."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.walks = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids)

    def named_parameters(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        self.walks += 1
        return super().named_parameters(*args, **kwargs)


def test_an_adapter_save_walks_the_model_once_and_restores(tmp_path) -> None:
    inner = Tied()
    for n, p in inner.named_parameters():
        p.requires_grad_(n.startswith("layers.0"))
    model = Counting(inner)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    model.walks = 0
    ck = ckpt.Checkpointer()
    ck.save(
        str(tmp_path / "a"), step=1, model=model, optimizer=opt, options=ckpt.SaveOptions(adapter_only=True)
    )
    assert model.walks == 1
    want = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    ckpt.restore(str(tmp_path / "a"), model=model, optimizer=opt)
    got = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_a_parameter_added_between_saves_is_saved_by_the_next(tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    ck = ckpt.Checkpointer()
    ck.save(str(tmp_path / "a"), step=1, model=model)
    model.append(torch.nn.Linear(3, 2))
    ck.save(str(tmp_path / "b"), step=2, model=model)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    ckpt.restore(str(tmp_path / "b"), model=fresh)
    assert torch.equal(fresh[1].weight, model[1].weight)

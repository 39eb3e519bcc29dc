"""Real text, a tokenizer trained on it here, and a tiny Llama: the inputs of the Trainer truth source.

Why these: the second source of truth (:mod:`ckpt.resume.truth_trainer`) must be runs the verifier's
thresholds never saw, made the way users make them.  No hub download is possible here, so the text is the
Python documentation that ships with every CPython (``pydoc_data.topics``: ~460 kB of English prose and code),
the tokenizer a byte-level BPE trained on it with Hugging Face ``tokenizers`` and wrapped as a
``PreTrainedTokenizerFast`` (what ``AutoTokenizer`` returns), and the model a ``LlamaForCausalLM`` of two
32-wide layers.  Everything is deterministic: the same ids in every process.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

VOCAB = 384
"""BPE vocabulary size: small enough that the embedding does not dominate the 2-layer model."""
SEQ = 32
"""Tokens per training example."""


@functools.lru_cache(maxsize=1)
def text() -> str:
    """The Python documentation topics (``help('topics')``), in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    """A byte-level BPE trained on :func:`text`, as a ``transformers.PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text().split("\n\n"), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@functools.lru_cache(maxsize=1)
def token_ids() -> torch.Tensor:
    """The whole text tokenized once (1-D int64)."""
    return torch.tensor(tokenizer()(text())["input_ids"], dtype=torch.int64)


def examples(n: int, offset: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` consecutive blocks of :data:`SEQ` tokens starting at block ``offset`` (wrapping around): a causal-LM
    dataset as ``Trainer`` takes it (``labels`` = ``input_ids``; the model shifts them)."""
    ids = token_ids()
    blocks = ids.numel() // SEQ
    out = []
    for i in range(n):
        b = (offset + i) % blocks
        x = ids[b * SEQ : (b + 1) * SEQ].clone()
        out.append({"input_ids": x, "labels": x.clone()})
    return out


def tiny_llama(seed: int) -> Any:
    """A 2-layer, 32-wide ``LlamaForCausalLM`` initialised from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)

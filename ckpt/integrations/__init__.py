"""Adapters that put ckpt inside training stacks people already use; each imports its framework lazily.

- :mod:`ckpt.integrations.transformers`: ``CkptCallback``, the run ledger from inside HF ``Trainer`` (and
  optimum-neuron's ``NeuronTrainer``, which calls the same callbacks).
"""

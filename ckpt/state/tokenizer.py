"""Tokenizer identity: name, revision and a hash of its files, from a tokenizer object or a folder.

A resumed or converted run that silently switched tokenizers trains on different token ids; the hash lets the
verifier say so.  Objects are hashed through ``save_pretrained`` into a temp folder, so the hash covers exactly
what the tokenizer would ship with the model.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

from ..errors import CkptError


def _hash_folder(path: str) -> tuple[str, list[str]]:
    h = hashlib.sha256()
    names = []
    for root, _dirs, files in os.walk(path):
        for name in sorted(files):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            names.append(rel)
    names.sort()
    for rel in names:
        h.update(rel.encode() + b"\0")
        with open(os.path.join(path, rel), "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest(), names


def identity(tokenizer: Any) -> dict[str, Any]:
    """``{"name", "revision", "sha256", "files"}`` for a tokenizer object, a folder path, or a name string."""
    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        if not os.path.isdir(path):
            raise CkptError(f"tokenizer folder {path} does not exist (pass a tokenizer object or a folder)")
        digest, files = _hash_folder(path)
        return {
            "name": os.path.basename(os.path.abspath(path)),
            "revision": None,
            "sha256": digest,
            "files": files,
        }
    if not hasattr(tokenizer, "save_pretrained"):
        raise CkptError(
            f"tokenizer of type {type(tokenizer).__name__} has no save_pretrained(): pass a folder path instead"
        )
    init = getattr(tokenizer, "init_kwargs", {}) or {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        digest, files = _hash_folder(tmp)
    return {
        "name": getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__,
        "revision": init.get("_commit_hash") or init.get("revision"),
        "class": type(tokenizer).__name__,
        "vocab_size": getattr(tokenizer, "vocab_size", None),
        "sha256": digest,
        "files": files,
    }

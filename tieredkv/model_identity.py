"""One model id for a local model directory, whichever way its path is spelled.

A block's key chain is seeded by the spec's namespace, which includes ``model_id``. For a hub name
(``"Qwen/Qwen2-7B"``) the name is the identity. For a local directory the path is not: ``dir``,
``dir/``, ``./dir`` and ``/abs/dir`` are one model, the HF side and vLLM's ``--model`` spell it as each
caller typed it, and a copy of the same weights on another host (the remote tier) lives at another
path. What makes two directories the same model for KV purposes is what decides the KV: the weights
and ``config.json`` (rope settings, norms...). The tokenizer does not enter: keys are token ids.

``local_model_id(dir)`` is ``"<directory name>@local-<digest>"``: the name keeps segment and directory
names readable (``KVSpec.slug`` reads the part before ``@``), the digest (xxh3-128 of ``config.json``
and of every weight file's name, size and bytes) is the identity. Reading the weights costs one pass
over them per process (memoised by file size and mtime): well under a second for a small model, about
as long as reading the files for a large one. Pass ``model_id`` explicitly to skip it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import xxhash

#: Files whose bytes decide the model's KV. Tokenizer, generation and README files do not.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")

_memo: dict[tuple, str] = {}
_memo_lock = threading.Lock()


def is_model_dir(path: str | os.PathLike, config: str = "config.json") -> bool:
    """True when ``path`` is a directory holding a ``config.json`` (a local model, not a hub name);
    ``config="adapter_config.json"``: a local peft adapter."""
    try:
        return (Path(path) / config).is_file()
    except (OSError, ValueError):
        return False


def _files(directory: Path, config: str = "config.json") -> list[Path]:
    found = [directory / config]
    for p in sorted(directory.iterdir()):
        if p.suffix in WEIGHT_SUFFIXES and p.is_file():
            found.append(p)
    return found


def local_model_id(path: str | os.PathLike) -> str:
    """The canonical model id of the model directory ``path`` (see the module's docstring).

    Raises:
        OSError: the directory or one of its files cannot be read.
    """
    directory = Path(os.path.realpath(path))
    return f"{directory.name or 'model'}@local-{_digest(directory, _files(directory))}"


def local_adapter_digest(path: str | os.PathLike) -> str:
    """The digest of a local adapter directory's ``adapter_config.json`` and weight files: an adapter
    retrained or replaced in place under the same name and path has another one (memoised as
    ``local_model_id``).

    Raises:
        OSError: the directory or one of its files cannot be read.
    """
    directory = Path(os.path.realpath(path))
    return _digest(directory, _files(directory, "adapter_config.json"))


def _digest(directory: Path, files: list[Path]) -> str:
    """xxh3-128 (24 hex digits) of ``files``' names, sizes and bytes, memoised by their stat."""
    stats = tuple((p.name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
                  for p, st in ((p, p.stat()) for p in files))
    memo_key = (str(directory), stats)
    with _memo_lock:
        known = _memo.get(memo_key)
    if known is not None:
        return known
    h = xxhash.xxh3_128()
    for p in files:
        name = p.name.encode()
        h.update(len(name).to_bytes(4, "little") + name + p.stat().st_size.to_bytes(8, "little"))
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()[:24]
    with _memo_lock:
        _memo[memo_key] = digest
    return digest


def canonical_model_id(name: str, revision: str | None = None) -> str:
    """``local_model_id(name)`` when ``name`` is a local model directory (its files name it), else
    ``name`` unchanged, with ``@revision`` when a revision of that hub name is pinned."""
    if name and is_model_dir(name):
        return local_model_id(name)
    return f"{name}@{revision}" if revision else name

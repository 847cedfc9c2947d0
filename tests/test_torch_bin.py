"""PyTorch ``.bin`` checkpoints read without torch and without running the pickle (``mia.models.torch_bin``).

torch writes the files here (the reader never imports it); each is compared bit for bit with torch's own tensors or
with a safetensors twin, and pickles that name any other global are refused without running it.
"""
import collections
import json
import os
import pickle
import shutil
import zipfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mia.models as mm  # noqa: E402
from mia.models.hub import CheckpointError, read_safetensors, read_weights, write_safetensors  # noqa: E402
from mia.models.torch_bin import read_torch_bin  # noqa: E402


def _bits(a: np.ndarray) -> np.ndarray:
    """The raw bytes of each element (bit-identity, NaN and -0.0 included)."""
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.itemsize > 1 else a.view(np.uint8)


def _torch_bits(t) -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return _bits(t.numpy())


def _views_state_dict():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    sd = collections.OrderedDict()
    sd["plain"] = torch.randn(3, 4, generator=g)
    sd["transposed"] = base.t()  # strides (1, 8)
    sd["offset_slice"] = base[2:5, 1::3]  # storage offset and a step
    sd["shares_storage"] = base  # the same storage as the two above
    sd["tied"] = sd["plain"]  # one tensor saved under two names
    sd["half"] = torch.randn(5, 3, generator=g).half()[1:]
    sd["bf16"] = torch.randn(4, 6, generator=g).to(torch.bfloat16).t()
    sd["double"] = torch.randn(3, generator=g).double()
    sd["scalar"] = torch.tensor(-0.0)
    sd["nan"] = torch.tensor([float("nan"), float("inf"), -1e-40])
    sd["empty"] = torch.zeros(0, 4)
    sd["ints"] = torch.arange(-5, 5, dtype=torch.int64)
    sd["int8"] = torch.arange(-3, 3, dtype=torch.int8)
    sd["mask"] = torch.tensor([True, False, True])
    sd["param"] = torch.nn.Parameter(torch.randn(2, 2, generator=g))
    return sd


def test_torch_save_tensors_read_bit_identically(tmp_path):
    sd = _views_state_dict()
    torch.save(sd, tmp_path / "pytorch_model.bin")
    out = read_torch_bin(tmp_path / "pytorch_model.bin", error=CheckpointError)
    assert sorted(out) == sorted(sd)
    for name, t in sd.items():
        assert out[name].shape == tuple(t.shape), name
        assert str(out[name].dtype) == str(t.dtype).replace("torch.", ""), name
        assert np.array_equal(_bits(out[name]), _torch_bits(t)), name
        assert not out[name].flags.writeable, name


def test_tensors_are_views_of_the_file_not_copies(tmp_path):
    torch.save({"w": torch.randn(64, 64)}, tmp_path / "w.bin")
    w = read_torch_bin(tmp_path / "w.bin")["w"]
    base = w
    while getattr(base, "base", None) is not None:
        base = base.base
    assert isinstance(base, np.memmap) or "mmap" in type(base).__name__


def test_module_state_dict_with_metadata(tmp_path):
    """``Module.state_dict()`` is an OrderedDict carrying ``_metadata`` (set by the pickle's BUILD)."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    torch.save(net.state_dict(), tmp_path / "m.bin")
    out = read_torch_bin(tmp_path / "m.bin")
    assert type(out) is dict and sorted(out) == sorted(net.state_dict())
    for k, v in net.state_dict().items():
        assert np.array_equal(_bits(out[k]), _torch_bits(v))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_bin_and_safetensors_twins_read_and_load_identically(tiny_neox_dir, tmp_path, dtype):
    """The same weights as model.safetensors and as torch.save'd pytorch_model.bin: identical tensors (bit for bit)
    and identical loaded params."""
    tdtype = getattr(torch, dtype)
    weights = read_safetensors(tiny_neox_dir / "model.safetensors")
    src = {k: torch.from_numpy(np.array(v)).to(tdtype) for k, v in weights.items()}
    st_dir, bin_dir = tmp_path / "st", tmp_path / "bin"
    for d in (st_dir, bin_dir):
        shutil.copytree(tiny_neox_dir, d, ignore=shutil.ignore_patterns("model.safetensors"))
    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": mm.hub.ml_dtypes.bfloat16}[dtype]
    write_safetensors({k: np.array(v.float().numpy()).astype(np_dtype) for k, v in src.items()},
                      st_dir / "model.safetensors")
    torch.save(src, bin_dir / "pytorch_model.bin")
    a, b = read_weights(st_dir / "model.safetensors"), read_weights(bin_dir / "pytorch_model.bin")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(_bits(a[k]), _bits(b[k])), k
    pa = mm.load(st_dir, dtype="float32", tokenizer=False).params
    pb = mm.load(bin_dir, dtype="float32", tokenizer=False).params
    for x, y in zip(jax_leaves(pa), jax_leaves(pb)):
        assert np.array_equal(_bits(x), _bits(y))


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_sharded_bin_index_loads_like_the_single_file(tiny_neox_dir, tmp_path):
    weights = read_safetensors(tiny_neox_dir / "model.safetensors")
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in weights.items()}
    names = sorted(tensors)
    shards = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    d = tmp_path / "sharded"
    shutil.copytree(tiny_neox_dir, d, ignore=shutil.ignore_patterns("model.safetensors"))
    for file, keys in shards.items():
        torch.save({k: tensors[k] for k in keys}, d / file)
    (d / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    ref, got = mm.load(tiny_neox_dir, tokenizer=False), mm.load(d, tokenizer=False)
    for x, y in zip(jax_leaves(ref.params), jax_leaves(got.params)):
        assert np.array_equal(x, y)
    assert got.fingerprint != ref.fingerprint  # other files, other content address
    (d / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(CheckpointError, match="shard file.*missing.*00002"):
        mm.load(d, tokenizer=False)


def test_safetensors_preferred_over_bin(tiny_neox_dir, tmp_path):
    d = tmp_path / "both"
    shutil.copytree(tiny_neox_dir, d)
    (d / "pytorch_model.bin").write_bytes(b"not even a zip")  # never opened
    ref, got = mm.load(tiny_neox_dir, tokenizer=False), mm.load(d, tokenizer=False)
    for x, y in zip(jax_leaves(ref.params), jax_leaves(got.params)):
        assert np.array_equal(x, y)


# ---------------------------------------------------------------------------------------------- refusals
class _Payload:
    """Pickles as ``os.system(command)``: an ordinary unpickler runs the command."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class _Eval:
    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return eval, (self.code,)


def _zip_checkpoint(path, data_pkl: bytes, prefix="archive"):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{prefix}/data.pkl", data_pkl)
        z.writestr(f"{prefix}/byteorder", "little")
        z.writestr(f"{prefix}/version", "3\n")
    return path


def test_payload_runs_under_an_ordinary_unpickler(tmp_path):
    """The control: the payload used below is live (plain ``pickle.loads`` creates the sentinel)."""
    sentinel = tmp_path / "ran"
    pickle.loads(pickle.dumps({"w": _Payload(f"touch {sentinel}")}, protocol=2))
    assert sentinel.exists()


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_os_system_is_refused_and_never_run(tmp_path, protocol):
    sentinel = tmp_path / "ran"
    data = pickle.dumps({"w": _Payload(f"touch {sentinel}")}, protocol=protocol)
    path = _zip_checkpoint(tmp_path / "pytorch_model.bin", data)
    with pytest.raises(CheckpointError, match=r"refused: the pickle asks for the global (os|posix)\.system"):
        read_torch_bin(path, error=CheckpointError)
    assert not sentinel.exists()


def test_payload_inside_a_real_torch_save_is_refused(tmp_path):
    """A genuine torch.save archive whose state dict also carries one hostile object: refused, nothing runs."""
    sentinel = tmp_path / "ran"
    torch.save({"w": torch.ones(3), "x": _Payload(f"touch {sentinel}")}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"(os|posix)\.system"):
        read_torch_bin(tmp_path / "pytorch_model.bin", error=CheckpointError)
    assert not sentinel.exists()


@pytest.mark.parametrize("payload, name", [
    (lambda s: _Eval(f"open({str(s)!r}, 'w')"), "(__builtin__|builtins).eval"),
    (lambda s: collections.Counter(), "collections.Counter"),  # harmless, but not a state dict's
    (lambda s: np.ones(2), "numpy"),
    (lambda s: torch.nn.Linear(1, 1), "torch.nn"),
])
def test_any_other_global_is_refused_by_name(tmp_path, payload, name):
    sentinel = tmp_path / "ran"
    path = _zip_checkpoint(tmp_path / "x.bin", pickle.dumps({"w": payload(sentinel)}, protocol=2))
    with pytest.raises(CheckpointError, match=r"refused: the pickle asks for the global " + name):
        read_torch_bin(path, error=CheckpointError)
    assert not sentinel.exists()


def test_loading_a_hostile_checkpoint_directory_fails_cleanly(tiny_neox_dir, tmp_path):
    sentinel = tmp_path / "ran"
    d = tmp_path / "model"
    shutil.copytree(tiny_neox_dir, d, ignore=shutil.ignore_patterns("model.safetensors"))
    torch.save({"gpt_neox.embed_in.weight": _Payload(f"touch {sentinel}")}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*(os|posix)\.system"):
        mm.load(d)
    assert not sentinel.exists()


def test_legacy_and_non_zip_files_are_refused(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="legacy.*non-zip"):
        read_torch_bin(tmp_path / "legacy.bin", error=CheckpointError)
    (tmp_path / "junk.bin").write_bytes(b"\x00" * 100)
    with pytest.raises(CheckpointError, match="not a PyTorch zip checkpoint"):
        read_torch_bin(tmp_path / "junk.bin", error=CheckpointError)
    with zipfile.ZipFile(tmp_path / "other.bin", "w") as z:
        z.writestr("code/model.py", "x = 1")
    with pytest.raises(CheckpointError, match="no <name>/data.pkl"):
        read_torch_bin(tmp_path / "other.bin", error=CheckpointError)


class _Storage:
    def __init__(self, key, numel):
        self.key, self.numel = key, numel


class _HandWritten(pickle.Pickler):
    """Writes torch's own pickle records (rebuild call, storage persistent id) around hand-chosen numbers."""

    def persistent_id(self, obj):
        return ("storage", torch.FloatStorage, obj.key, "cpu", obj.numel) if isinstance(obj, _Storage) else None


def _hand_checkpoint(path, numel, offset, size, stride, member_floats=None):
    import io

    buf = io.BytesIO()
    view = _rebuild(_Storage("0", numel), offset, size, stride)
    _HandWritten(buf, protocol=2).dump({"w": view})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/data/0", np.arange(numel if member_floats is None else member_floats,
                                               dtype=np.float32).tobytes())
    return path


class _rebuild:
    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, (*self.args, False, collections.OrderedDict())


def test_hand_written_view_reads_the_right_elements(tmp_path):
    path = _hand_checkpoint(tmp_path / "v.bin", numel=20, offset=3, size=(3, 2), stride=(5, 2))
    got = read_torch_bin(path)["w"]
    want = np.array([[3 + 5 * i + 2 * j for j in range(2)] for i in range(3)], np.float32)
    assert np.array_equal(got, want)


def test_view_past_its_storage_and_size_mismatch_are_refused(tmp_path):
    path = _hand_checkpoint(tmp_path / "v.bin", numel=20, offset=3, size=(4, 2), stride=(5, 2))  # reaches 20
    with pytest.raises(CheckpointError, match="reaches element 20, past the storage's 20"):
        read_torch_bin(path, error=CheckpointError)
    path = _hand_checkpoint(tmp_path / "s.bin", numel=20, offset=0, size=(2,), stride=(1,), member_floats=10)
    with pytest.raises(CheckpointError, match="has 40 bytes; the pickle declares 20 elements"):
        read_torch_bin(path, error=CheckpointError)


def test_not_a_flat_state_dict_is_refused(tmp_path):
    torch.save({"state_dict": {"w": torch.ones(2)}}, tmp_path / "nested.bin")
    with pytest.raises(CheckpointError, match="'state_dict' is not a tensor"):
        read_torch_bin(tmp_path / "nested.bin", error=CheckpointError)
    torch.save([torch.ones(2)], tmp_path / "list.bin")
    with pytest.raises(CheckpointError, match="holds list, not a state dict"):
        read_torch_bin(tmp_path / "list.bin", error=CheckpointError)

"""Hugging Face PEFT LoRA adapters, merged into a base checkpoint's tensors at load (docs/models.md#adapters).

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``adapter_model.bin``, read
by ``torch_bin`` without running its pickle). Its tensors are named after the torch modules of the base model:
``base_model.model.<module>.lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r] for a linear layer,
``<module>.lora_embedding_A`` [r, V] and ``lora_embedding_B`` [D, r] for an embedding, and any other
``base_model.model.<name>`` (``modules_to_save``, trained biases) replaces the base tensor ``<name>`` whole.

The merge works on the checkpoint's own (HF-named, HF-shaped) tensors, before the family's ``param_mappings`` split or
transpose them: so a LoRA on a fused HF linear (GPT-NeoX ``query_key_value``, GPT-2 ``c_attn``) is merged exactly as
peft merges it, and every family, present or future, is covered by its mapping alone. Per module, in float32:

    W' = W + s * (B @ A)          torch Linear, weight [out, in]
    W' = W + s * (B @ A)^T        GPT-2 Conv1D (weight [in, out], peft's ``fan_in_fan_out``) and embeddings [V, D]
    s  = alpha / r                (``use_rslora``: alpha / sqrt(r)); r and alpha per module from ``rank_pattern`` /
                                  ``alpha_pattern`` (peft's ``get_pattern_key``), else ``r`` / ``lora_alpha``

The merged tensors are float32; the loader casts them to the run's parameter dtype like any other tensor. Anything
that would make the merged model differ from peft's ``merge_and_unload()`` is refused in one line naming the field
(``AdapterError``).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .common import ParamMapping

PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# adapter_config.json fields whose non-default value changes the merged weights in a way not implemented here
REFUSED_FIELDS = {
    "use_dora": lambda v: bool(v), "lora_bias": lambda v: bool(v), "use_qalora": lambda v: bool(v),
    "layer_replication": lambda v: bool(v), "target_parameters": lambda v: bool(v),
    "trainable_token_indices": lambda v: bool(v), "alora_invocation_tokens": lambda v: bool(v),
    "use_bdlora": lambda v: bool(v),
}
# transformers' module name of the LM head -> the checkpoint's (GPT-NeoX's module ``lm_head`` is saved as ``embed_out``)
HEAD_MODULE = "lm_head"


class AdapterError(ValueError):
    """An adapter directory that cannot be merged exactly: one line naming the file and the field."""


def adapter_weight_file(root: Path) -> Path:
    """``adapter_model.safetensors``, else ``adapter_model.bin``; ``AdapterError`` when neither is there."""
    for name in WEIGHT_FILES:
        if (root / name).is_file():
            return root / name
    raise AdapterError(f"{root}: no {' or '.join(WEIGHT_FILES)} found")


def read_adapter_config(root: Path) -> dict:
    """``adapter_config.json`` of an adapter directory, checked: a LoRA (``peft_type``), none of ``REFUSED_FIELDS``."""
    f = Path(root) / CONFIG_FILE
    if not f.is_file():
        raise AdapterError(f"{root}: {CONFIG_FILE} is missing (not a PEFT adapter directory)")
    try:
        conf = json.loads(f.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise AdapterError(f"{f}: invalid JSON ({e})") from None
    if not isinstance(conf, dict):
        raise AdapterError(f"{f}: must hold a JSON object")
    kind = conf.get("peft_type")
    if kind != "LORA":
        raise AdapterError(f"{f}: field peft_type={kind!r} is not supported (only LoRA adapters, peft_type 'LORA')")
    for field, bad in REFUSED_FIELDS.items():
        if field in conf and bad(conf[field]):
            raise AdapterError(f"{f}: field {field}={conf[field]!r} is not supported (plain LoRA only)")
    for field in ("r", "lora_alpha"):
        v = conf.get(field)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise AdapterError(f"{f}: field {field}={v!r} must be a positive number")
    for field in ("rank_pattern", "alpha_pattern"):
        if not isinstance(conf.get(field) or {}, dict):
            raise AdapterError(f"{f}: field {field} must be an object (module pattern -> number)")
    return conf


def adapter_digest(root: Path, file_sha256: Callable[[Path], str]) -> str:
    """Content address of an adapter: its config and weight file (``file_sha256``: the memoised file hash)."""
    root = Path(root)
    weights = adapter_weight_file(root)
    h = hashlib.sha256(b"mia-adapter|1")
    h.update(f"|{CONFIG_FILE}:{hashlib.sha256((root / CONFIG_FILE).read_bytes()).hexdigest()}".encode())
    h.update(f"|{weights.name}:{file_sha256(weights)}".encode())
    return h.hexdigest()[:32]


# ------------------------------------------------------------------------------------------------ peft's matching
def pattern_key(patterns, module: str) -> Optional[str]:
    """The first key of ``rank_pattern``/``alpha_pattern`` that matches ``module`` as peft's ``get_pattern_key``
    does (the regex matches the module name or a dotted suffix of it), else None."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def layer_index(conf: dict, module: str) -> Optional[int]:
    """The decoder-layer index in ``module``'s name as peft finds it for ``layers_to_transform``: the first number
    after ``layers_pattern`` (any of them), or without one the first numbered segment."""
    patterns = conf.get("layers_pattern")
    if not patterns:
        found = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        found = None
        for p in [patterns] if isinstance(patterns, str) else patterns:
            found = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module)
            if found:
                break
    return int(found.group("idx")) if found else None


def _listed(names, module: str) -> bool:
    return module in names or any(module.endswith(f".{n}") for n in names)


def targeted(conf: dict, module: str) -> bool:
    """Whether peft puts a LoRA on ``module`` (its ``check_target_module_exists``): not excluded
    (``exclude_modules``), not one of ``modules_to_save``, and matched by ``target_modules`` (a regex: full match;
    a list: the name or a dotted suffix; ``all-linear``: every linear layer but the LM head) within
    ``layers_to_transform``."""
    excl = conf.get("exclude_modules")
    if excl and (re.fullmatch(excl, module) if isinstance(excl, str) else _listed(excl, module)):
        return False
    if any(re.match(rf"(^|.*\.){m}($|\..*)", module) for m in conf.get("modules_to_save") or ()):
        return False
    target = conf.get("target_modules")
    if target == "all-linear":
        return module != HEAD_MODULE
    if isinstance(target, str):
        return re.fullmatch(target, module) is not None
    if not _listed(target or (), module):
        return False
    layers = conf.get("layers_to_transform")
    if layers is None or (isinstance(layers, list) and not layers):
        return True
    idx = layer_index(conf, module)
    return idx is not None and (idx == layers if isinstance(layers, int) else idx in layers)


# ------------------------------------------------------------------------------------------------ the merge
def lora_modules(tensors: dict, source: str) -> tuple[dict, dict]:
    """Split an adapter's tensors into ({module: {"A": [r, in], "B": [out, r], "embedding": bool}}, {base tensor
    name: replacement}) with peft's ``base_model.model.`` prefix removed."""
    lora: dict = {}
    whole: dict = {}
    for key, arr in tensors.items():
        if not key.startswith(PREFIX):
            raise AdapterError(f"{source}: tensor {key!r} does not start with {PREFIX!r} (not a peft adapter tensor)")
        name = key[len(PREFIX):]
        m = re.fullmatch(r"(?P<module>.+)\.lora_(?P<kind>embedding_)?(?P<ab>[AB])(?:\.default)?(?:\.weight)?", name)
        if m is None:
            if ".lora_" in name:
                raise AdapterError(f"{source}: tensor {key!r} is not a LoRA A/B factor this reader knows")
            whole[name] = arr
            continue
        entry = lora.setdefault(m["module"], {"embedding": bool(m["kind"])})
        entry[m["ab"]] = arr
    for module, entry in lora.items():
        if "A" not in entry or "B" not in entry:
            raise AdapterError(f"{source}: module {module!r} has lora_{'B' if 'A' in entry else 'A'} but not "
                               f"lora_{'A' if 'A' in entry else 'B'}")
    return lora, whole


def checkpoint_name(name: str, tensors: dict, head: str) -> Optional[str]:
    """The base checkpoint's name for the torch parameter ``name`` (module path + ``.weight``/``.bias``): itself, or
    without the model prefix (a checkpoint saved from the bare base model), or the family's head name for
    transformers' ``lm_head``; None when the checkpoint has no such tensor."""
    candidates = [name, name.split(".", 1)[1] if "." in name else name]
    if name.startswith(HEAD_MODULE + "."):
        candidates.append(head + name[len(HEAD_MODULE):])
    return next((c for c in candidates if c in tensors), None)


def merge_lora(tensors: dict, conf: dict, adapter: dict, mappings: list[ParamMapping], head: str,
               source: str) -> dict:
    """The base checkpoint's ``tensors`` (HF names -> arrays) with the adapter merged: the LoRA deltas added in float32
    (module docstring) and the whole tensors replaced. ``mappings``: the family's ``param_mappings`` (which tensors
    are stored [out, in], i.e. transposed into our kernels: torch Linear; which [in, out]: Conv1D; which are
    embeddings); ``head``: the family's LM-head module name in the checkpoint. Returns a new dict; the base arrays
    are not modified."""
    lora, whole = lora_modules(adapter, source)
    by_name = {m.hf_name: m for m in mappings}
    by_name.update({(n.split(".", 1)[1] if "." in n else n): m for n, m in list(by_name.items())})
    out = dict(tensors)
    modules = sorted({n.rsplit(".", 1)[0] for n in by_name})
    check_targets(conf, modules, head, source)
    r0, alpha0 = conf["r"], conf["lora_alpha"]
    ranks, alphas = conf.get("rank_pattern") or {}, conf.get("alpha_pattern") or {}
    for module, entry in sorted(lora.items()):
        name = checkpoint_name(f"{module}.weight", tensors, head)
        if name is None:
            raise AdapterError(f"{source}: LoRA on module {module!r}, which the base checkpoint does not have")
        if not targeted(conf, module):
            raise AdapterError(f"{source}: LoRA tensors for module {module!r}, which target_modules / "
                               "layers_to_transform / exclude_modules do not select")
        a, b = np.asarray(entry["A"], np.float32), np.asarray(entry["B"], np.float32)
        key_r, key_a = pattern_key(ranks, module), pattern_key(alphas, module)
        r = ranks[key_r] if key_r is not None else r0
        field = f"rank_pattern[{key_r!r}]" if key_r is not None else "r"
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
            raise AdapterError(f"{source}: field {field}={r} disagrees with the rank of module {module!r}'s tensors "
                               f"(lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)})")
        alpha = alphas[key_a] if key_a is not None else alpha0
        scale = alpha / np.sqrt(r) if conf.get("use_rslora") else alpha / r
        delta = orient(b @ a, name, by_name.get(name), entry["embedding"], conf, tensors[name].shape, source)
        out[name] = (np.asarray(tensors[name], np.float32) + np.float32(scale) * delta).astype(np.float32)
    for pname, arr in sorted(whole.items()):
        name = checkpoint_name(_without_wrapper(pname), tensors, head)
        if name is None:
            raise AdapterError(f"{source}: tensor {PREFIX + pname!r} replaces {pname!r}, which the base checkpoint "
                               "does not have (modules_to_save on a tied LM head is not supported)")
        if tuple(arr.shape) != tuple(tensors[name].shape):
            raise AdapterError(f"{source}: tensor {PREFIX + pname!r} has shape {tuple(arr.shape)}, the base tensor "
                               f"{name!r} {tuple(tensors[name].shape)}")
        out[name] = np.asarray(arr, np.float32)
    return out


def _without_wrapper(name: str) -> str:
    """``x.modules_to_save.default.weight`` (an unsaved wrapper path) -> ``x.weight``."""
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)


def orient(ba: np.ndarray, name: str, mapping: Optional[ParamMapping], embedding: bool, conf: dict, shape,
           source: str) -> np.ndarray:
    """B @ A [out, in] laid out as the checkpoint tensor ``name`` of ``shape``: as it is for a torch Linear ([out,
    in]); transposed for an embedding ([V, D], peft's factors A [r, V], B [D, r]) and for a Conv1D ([in, out]). The
    layout comes from the family's mapping (a kernel read with ``transpose`` is a Linear, without it a Conv1D), as
    peft decides ``fan_in_fan_out`` from the layer type; without a mapping, from ``fan_in_fan_out``."""
    if embedding:
        linear = False
    elif mapping is not None and mapping.path[-1] == "kernel":
        linear = mapping.transpose
    else:
        linear = not conf.get("fan_in_fan_out", False)
    delta = ba if linear else ba.T
    if tuple(delta.shape) != tuple(shape):
        raise AdapterError(f"{source}: LoRA delta of {name!r} has shape {tuple(delta.shape)} (lora_B @ lora_A"
                           f"{'' if linear else ', transposed'}), the base tensor {tuple(shape)}")
    return delta


def check_targets(conf: dict, modules: list, head: str, source: str) -> None:
    """Every name of a list ``target_modules`` (and a regex one) matches some module of the base model, or one
    ``AdapterError`` naming it; ``modules``: the base checkpoint's module names (HF tensor names without the
    parameter), the head also under transformers' ``lm_head``."""
    names = set(modules) | {HEAD_MODULE} | {m.split(".", 1)[1] for m in modules if "." in m}
    target = conf.get("target_modules")
    if target is None or target == "all-linear":
        return
    if isinstance(target, str):
        if not any(re.fullmatch(target, m) for m in names):
            raise AdapterError(f"{source}: field target_modules={target!r} matches no module of the base model")
        return
    for t in target:
        if not any(m == t or m.endswith("." + t) for m in names):
            raise AdapterError(f"{source}: field target_modules entry {t!r} matches no module of the base model")

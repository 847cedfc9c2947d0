"""A testbed LoRA fine-tune (``mia.testbed.finetune``) as a Hugging Face PEFT adapter directory.

``write_peft_adapter(run, out_dir)`` writes ``adapter_config.json`` and ``adapter_model.safetensors`` as peft's
``save_pretrained`` does, so that ``mia.load(BASE, adapter=DIR)``, ``mia score --adapter DIR`` and peft in torch
(``PeftModel.from_pretrained`` on the base checkpoint) all see the fine-tune. The testbed keeps each adapted kernel
as W [in, out] + s A B with A [L, in, r] and B [L, r, out] (stacked over layers); the base checkpoint stores the
same kernel under its HF name as a torch Linear weight [out, in] (the family's ``param_mappings`` say which name and
whether it is transposed), where peft adds s lora_B @ lora_A. So per layer i:

    lora_A.weight = A[i]^T  [r, in]        lora_B.weight = B[i]^T  [out, r]        (s = lora_alpha / r)

and for a kernel stored untransposed (GPT-2's Conv1D, [in, out]) the same factors with ``fan_in_fan_out``.
A LoRA fine-tune of a base with reserved tokens also trains those tokens' embedding rows, which a plain LoRA adapter
cannot hold: refused.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..files.atomic import write_text
from ..models import load_config
from ..models.adapter import CONFIG_FILE, PREFIX
from ..models.hub import read_safetensors, write_safetensors
from .config import TestbedError

WEIGHT_FILE = "adapter_model.safetensors"


def lora_module_names(fam, cfg, target: str) -> list:
    """[(layer, HF module name, transposed)] of our stacked kernel ``layers.<target>.kernel`` in family ``fam``
    (``gpt_neox.layers.0.attention.query_key_value``, True for a torch Linear)."""
    found = [(m.layer, m.hf_name[:-len(".weight")], m.transpose) for m in fam.param_mappings(cfg)
             if m.path[-3:] == ("layers", target, "kernel") and m.layer is not None]
    if not found:
        raise TestbedError(f"LoRA target {target!r} has no HF tensor in the base's family ({fam.model_type})")
    return sorted(found)


def write_peft_adapter(run, out_dir) -> Path:
    """Write the LoRA of the fine-tune ``run`` (a ``Finetune`` with ``lora_rank`` > 0) to ``out_dir`` as a PEFT
    adapter of its base's last checkpoint; returns ``out_dir``."""
    cfg = run.config
    if not cfg.lora_rank:
        raise TestbedError(f"{run.root}: a full-parameter fine-tune has no LoRA adapter to export")
    if run.base.config.reserved_tokens:
        raise TestbedError(f"{run.root}: its LoRA also trained the base's reserved-token embedding rows, which a "
                           "plain LoRA adapter cannot hold; use a base without reserved tokens")
    base_dir = run.base.checkpoint_dir(run.base.train_steps)
    fam, mcfg, _ = load_config(base_dir)
    factors = read_safetensors(run.root / "lora.safetensors")
    tensors, suffixes, fan_in_fan_out = {}, [], set()
    for target in cfg.lora_targets:
        for layer, module, transposed in lora_module_names(fam, mcfg, target):
            a, b = np.asarray(factors[f"{target}.A"][layer]), np.asarray(factors[f"{target}.B"][layer])
            tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.T, np.float32)
            tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.T, np.float32)
            fan_in_fan_out.add(not transposed)
            suffix = module.split(f".{layer}.", 1)[1]  # the module's name inside its layer: attention.dense
            if suffix not in suffixes:
                suffixes.append(suffix)
    if len(fan_in_fan_out) != 1:
        raise TestbedError(f"{run.root}: LoRA targets mix Linear and Conv1D layers; peft's fan_in_fan_out is one flag")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, out / WEIGHT_FILE, metadata={"format": "pt"})
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_dir),
            "r": int(cfg.lora_rank), "lora_alpha": float(cfg.lora_scale * cfg.lora_rank), "lora_dropout": 0.0,
            "target_modules": suffixes, "fan_in_fan_out": fan_in_fan_out.pop(), "bias": "none",
            "use_rslora": False, "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
            "rank_pattern": {}, "alpha_pattern": {}}
    write_text(out / CONFIG_FILE, json.dumps(conf, indent=2, sort_keys=True))
    return out

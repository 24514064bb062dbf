"""`attnres-pp train --init-from DIR`: a new standard-residual run that starts from the weights of a
Hugging Face folder of the Llama recipe (`LlamaForCausalLM`, or `Qwen3ForCausalLM` with QK-norm; the
mixtures of experts `MixtralForCausalLM` and `Qwen3MoeForCausalLM`, whose selection bias starts at
zero; what `attnres-pp export` writes for such a run) instead of the seeded initialisation.

The folder is read (config.json, then the safetensors through the `safetensors` library, which runs
no code) and checked against the run's model before anything starts: a differing field is one
`error:` line naming it. The weights are copied into the model before step 0 (`load_initial`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from attnres_pp.model.config import ModelConfig
from attnres_pp.train.hf_llama import ARCHITECTURES
from attnres_pp.train.hf_moe import folder_fields, from_hf, our_fields, to_hf
from attnres_pp.train.metadata_pickle import read_regular_file

MAX_CONFIG_BYTES = 1 << 20
# The flag (or TOML key) that sets each compared field, for the error line.
FLAGS = {"residual": "--residual", "positions": "--positions", "mlp": "--mlp", "vocab_size": "--vocab-size",
         "d_model": "--d-model", "n_layers": "--layers", "n_heads": "--heads", "kv_heads": "--kv-heads",
         "ff_dim": "[model] d_ff", "head_dim": "--d-model / --heads", "qk_norm": "--qk-norm",
         "tie_embeddings": "--tie-embeddings", "norm_eps": "[model] norm_eps", "rope_theta": "--rope-theta",
         "moe_experts": "--moe-experts", "moe_top_k": "--moe-top-k", "expert_dim": "--moe-d-ff",
         "moe_dense_layers": "--moe-dense-layers", "moe_shared_experts": "--moe-shared-experts",
         "moe_router": "--moe-router"}
# Tensors a Llama folder may hold beside the parameters: rotary tables of older saves, a tied head.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _json(path: Path, what: str) -> dict:
    data = read_regular_file(path, MAX_CONFIG_BYTES, str(path))
    try:
        table = json.loads(data)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"--init-from: {path} is not valid JSON ({type(error).__name__})") from None
    if not isinstance(table, dict):
        raise ValueError(f"--init-from: {path} does not hold a JSON object ({what})")
    return table


def _weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: the index's shards, or model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json(index, "a weight_map").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"--init-from: {index} has no weight_map of tensor names to shard files")
        names = sorted(set(weight_map.values()))
        if any(Path(name).name != name or not name.endswith(".safetensors") for name in names):
            raise ValueError(f"--init-from: {index} names shard files outside its folder")
        return [folder / name for name in names]
    if not (folder / "model.safetensors").is_file():
        raise ValueError(f"--init-from {folder} holds neither model.safetensors nor model.safetensors.index.json")
    return [folder / "model.safetensors"]


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files by name."""
    try:
        from safetensors import SafetensorError
        from safetensors.torch import safe_open
    except ImportError:
        raise ValueError("--init-from reads safetensors: pip install 'attnres-pp[hf]' (or: pip install "
                         "safetensors)") from None
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as file:
                for name in file.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensors[name] = file.get_tensor(name)
        except (OSError, SafetensorError) as error:
            raise ValueError(f"--init-from: {path} is not a readable safetensors file ({error})") from None
    return tensors


def read_init_folder(folder: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The folder's weights under our names, float32, every parameter of the model `cfg` describes;
    ValueError naming what to fix (a field that differs, a missing or misshapen tensor)."""
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ValueError(f"--init-from {folder} has no config.json: give a Hugging Face model folder "
                         "(e.g. written by attnres-pp export)")
    hf = _json(path / "config.json", "a model config")
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise ValueError(f"--init-from {folder} holds a {kind!r} model: only {', '.join(ARCHITECTURES)} folders "
                         "(a standard-residual rope + swiglu model) start a run")
    theirs, ours = folder_fields(hf), our_fields(cfg)
    differ = [k for k in ours if k in theirs and ours[k] != theirs[k]]
    if differ:
        detail = "; ".join(f"{k} {ours[k]!r} vs {theirs[k]!r} ({FLAGS[k]})" for k in differ)
        raise ValueError(f"--init-from {folder}: the run's model differs from the folder's in {detail} "
                         "(run vs folder): give the flags that match the folder")
    tensors = read_safetensors(path)
    try:
        named = from_hf(tensors, cfg, kind)
    except KeyError as error:
        raise ValueError(f"--init-from {folder}: the weights lack the tensor {error}") from None
    except RuntimeError as error:  # experts of differing shapes cannot be stacked
        raise ValueError(f"--init-from {folder}: the experts' weights do not have one shape ({error})") from None
    return _checked(folder, cfg, named, tensors, kind)


def _checked(folder: str, cfg: ModelConfig, named: dict, tensors: dict, kind: str) -> dict[str, torch.Tensor]:
    from attnres_pp.model.transformer import Transformer

    with torch.device("meta"):
        expected = dict(Transformer(cfg, backend="torch").named_parameters())
    for name, param in expected.items():
        got = named[name]
        if tuple(got.shape) != tuple(param.shape) or not got.is_floating_point():
            raise ValueError(f"--init-from {folder}: {name} has shape {tuple(got.shape)} ({got.dtype}), the run's "
                             f"model needs {tuple(param.shape)} floats")
    used = set(to_hf(named, cfg, kind)) | {"lm_head.weight"} | {n for n in tensors if n.endswith(IGNORED_SUFFIXES)}
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise ValueError(f"--init-from {folder}: the weights hold {len(unknown)} tensors this model has no place "
                         f"for, e.g. {unknown[0]}: the folder is another architecture")
    return {name: named[name].to(torch.float32) for name in expected}


@torch.no_grad()
def load_initial(model: torch.nn.Module, named: dict[str, torch.Tensor]) -> None:
    """Copy `named` into `model`'s parameters (a tied head shares the embedding's)."""
    for name, param in model.named_parameters():
        param.copy_(named[name])

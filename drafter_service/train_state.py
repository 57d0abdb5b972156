"""Training checkpoints for `specwire train-eagle`: resume with the same parameters, optimizer moments,
data position and random state, so an interrupted run continues exactly where it stopped.

Two files, no pickle: state.safetensors (float32 parameters, AdamW moments, RNG states, the draft
vocabulary) and state.json (step, epoch, batch index, param groups, the run's log so far). Written to a
temporary folder and renamed, so a run killed while saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specwire.errors import ModelLoadError

STATE_FILE, META_FILE = "state.safetensors", "state.json"


def save_train_state(
    path: str | Path,
    params: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    draft_to_target: torch.Tensor | None,
    meta: dict,
) -> None:
    """Write the checkpoint folder `path` (replaced whole)."""
    path = Path(path)
    names = list(params)
    tensors = {f"param.{n}": p.detach().float().cpu().contiguous() for n, p in params.items()}
    state = optimizer.state_dict()
    for i, s in state["state"].items():
        for key, value in s.items():
            tensors[f"opt.{names[i]}.{key}"] = torch.as_tensor(value).float().cpu().contiguous()
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    if draft_to_target is not None:
        tensors["draft_to_target"] = draft_to_target.cpu().contiguous()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, tmp / STATE_FILE)
    (tmp / META_FILE).write_text(json.dumps({**meta, "param_names": names, "param_groups": groups}) + "\n")
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def load_train_state(
    path: str | Path,
    params: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    draft_to_target: torch.Tensor | None,
) -> dict:
    """Restore what save_train_state wrote into params, optimizer and draft_to_target; returns the meta."""
    path = Path(path)
    if not (path / STATE_FILE).is_file() or not (path / META_FILE).is_file():
        raise ModelLoadError(f"no training checkpoint ({STATE_FILE}, {META_FILE}) in {path}")
    tensors = load_file(path / STATE_FILE)
    meta = json.loads((path / META_FILE).read_text())
    if meta["param_names"] != list(params):
        raise ModelLoadError(f"checkpoint {path} is for another head (parameters differ)")
    with torch.no_grad():
        for n, p in params.items():
            saved = tensors[f"param.{n}"]
            if saved.shape != p.shape:
                raise ModelLoadError(
                    f"checkpoint {path}: {n} has shape {tuple(saved.shape)}, not {tuple(p.shape)}"
                )
            p.copy_(saved)
        if draft_to_target is not None:
            draft_to_target.copy_(tensors["draft_to_target"])
    state: dict = {"state": {}, "param_groups": []}
    for i, n in enumerate(meta["param_names"]):
        moments = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"opt.{n}.")}
        if moments:
            state["state"][i] = {k: v.to(params[n].device) if k != "step" else v for k, v in moments.items()}
    state["param_groups"] = [{**g, "params": list(range(len(params)))} for g in meta["param_groups"]]
    optimizer.load_state_dict(state)
    torch.set_rng_state(tensors["rng.cpu"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return meta

"""The sampling contract both planes share: the logprobs of the distribution actually sampled.

`nucleus_logprobs` is what an engine reports per token and what the hub's spot-check recomputes:
log_softmax(logits / T), restricted to the top-p nucleus and renormalised (vLLM's
"processed_logprobs"); top-k is off. `forward_cached` is one KV-cached step of a transformers
model; `copy_state` loads a state into a model in place, checking names and shapes first
(`check_state`; `copy_checked` when the caller has).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch


def nucleus_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probabilities of the sampling distribution: (B, V) logits -> (B, V), -inf outside."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, V)
    if top_p >= 1.0:
        return logprobs
    # Keep the smallest set of tokens whose mass reaches top_p (the top token always stays),
    # as in Holtzman et al. 2020 and the HF/vLLM samplers, then renormalise over it.
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)  # (B, V)
    mass_before = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()  # (B, V)
    drop_sorted = mass_before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(logprobs.masked_fill(drop, float("-inf")), dim=-1)


def check_names(state_names: set[str], required_names: set[str],
                named_tensors: Mapping[str, torch.Tensor]) -> None:
    """ValueError unless every name is in the state and every required (parameter) name is given.

    A tied lm_head is in the state but not among the parameters, so it may be absent.
    """
    unknown = sorted(set(named_tensors) - state_names)
    missing = sorted(required_names - set(named_tensors))
    if unknown or missing:
        raise ValueError(f"weights do not match the model: unknown names {unknown[:5]}"
                         f"{' ...' if len(unknown) > 5 else ''}, missing names {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")


# `cache`: the model's own KV cache object (transformers' kind depends on the model).
def forward_cached(model: torch.nn.Module, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
    """One KV-cached forward: (B, T) ids -> ((B, V) last-position logits, new cache).

    transformers 5.x calls the cache argument `cache`; older versions `past_key_values`.
    """
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, use_cache=True, **{key: cache})
    return out.logits[:, -1, :], out[key]


def check_state(shapes: Mapping[str, tuple[int, ...]], required_names: set[str],
                named_tensors: Mapping[str, torch.Tensor]) -> None:
    """ValueError unless `named_tensors` fits a model whose state has these `shapes`: names as
    in `check_names`, and every tensor of its name's shape. Checked before anything is copied,
    so a bad state never leaves a model half-loaded."""
    check_names(set(shapes), required_names, named_tensors)
    for name, tensor in named_tensors.items():
        if tuple(tensor.shape) != tuple(shapes[name]):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, model has {tuple(shapes[name])}")


def state_shapes(model: torch.nn.Module) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(state name -> shape, names of the parameters proper) of `model`, for `check_state`."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return shapes, {name for name, _ in model.named_parameters()}


def copy_state(model: torch.nn.Module, named_tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy `named_tensors` into `model`'s parameters in place, casting; ValueError on bad names
    or shapes, raised before anything is copied."""
    check_state(*state_shapes(model), named_tensors)
    copy_checked(model, named_tensors)


def copy_checked(model: torch.nn.Module, named_tensors: Mapping[str, torch.Tensor]) -> None:
    """`copy_state` for a state the caller has already passed through `check_state`."""
    state = dict(model.state_dict())
    with torch.no_grad():
        for name, tensor in named_tensors.items():
            state[name].copy_(tensor.to(device=state[name].device, dtype=state[name].dtype))

"""Rollout engines: sample n completions of a prompt with per-token logprobs, swap in weights.

`Engine` is the contract the peer client drives (from a worker thread, one call at a time).
`TransformersEngine` runs a transformers model anywhere torch runs; `VLLMEngine` runs vLLM.
Neither knows about tasks, rewards or the network.

Logprobs are those of the distribution actually sampled from: log_softmax(logits / T), restricted
to the top-p nucleus and renormalised when top_p < 1 (vLLM's "processed_logprobs"); top-k is off.
A completion that samples EOS ends there, and the EOS token and its logprob are kept, so the
learner also trains on when to stop; `text` is decoded without special tokens, by the rule the
hub scores with (`echo2p2p.completions.CompletionDecoder.completion`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from echo2p2p.completions import CompletionDecoder

from echo2p2p.messages import ENGINES
from .model import load_policy
from .sampling import check_names, copy_state, forward_cached, nucleus_logprobs

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]
    logprobs: list[float]  # one per token id, of the sampled token, <= 0
    text: str
    finish_reason: str  # "stop" (EOS sampled, and kept in token_ids) | "length"


class Engine(Protocol):
    tokenizer: Any

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a full state (HF names, any float dtype) into the model; ValueError on bad names."""
        ...

    def generate(self, prompt_ids: list[int], n: int, *, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int) -> list[Completion]:
        """`n` independent samples of continuations of `prompt_ids`; same seed, same samples."""
        ...


class TransformersEngine:
    """A transformers causal LM sampled with an explicit KV-cached loop (exact logprobs)."""

    def __init__(self, model: str, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
        self.model, self.tokenizer = load_policy(model, device=device, dtype=dtype)
        self.device = torch.device(device)
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id
        self.decoder = CompletionDecoder(self.tokenizer)  # the rule the hub scores by

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        copy_state(self.model, named_tensors)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], n: int, *, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int) -> list[Completion]:
        if n < 1 or not prompt_ids or temperature <= 0 or not 0 < top_p <= 1:
            raise ValueError(f"bad generate arguments: n={n}, prompt of {len(prompt_ids)} "
                             f"tokens, temperature={temperature}, top_p={top_p}")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        # All n rows share the prompt, so there is no padding: position ids are implicit.
        ids = torch.tensor([prompt_ids] * n, dtype=torch.long, device=self.device)  # (n, P)
        tokens = torch.empty((n, 0), dtype=torch.long, device=self.device)  # (n, t)
        logprobs = torch.empty((n, 0), dtype=torch.float32, device=self.device)  # (n, t)
        done = torch.zeros(n, dtype=torch.bool, device=self.device)  # (n,)
        cache = None
        for _ in range(max_new_tokens):
            logits, cache = forward_cached(self.model, ids, cache)  # (n, V)
            lp = nucleus_logprobs(logits, temperature, top_p)  # (n, V)
            nxt = torch.multinomial(lp.exp(), 1, generator=gen)  # (n, 1)
            nxt = nxt.masked_fill(done[:, None], self.pad_id)  # finished rows only idle
            tokens = torch.cat([tokens, nxt], dim=1)
            logprobs = torch.cat([logprobs, lp.gather(1, nxt)], dim=1)
            done |= nxt[:, 0] == self.eos_id
            if bool(done.all()):
                break
            ids = nxt
        return [self._completion(row, lps) for row, lps in zip(tokens.tolist(), logprobs.tolist())]

    def _completion(self, row: list[int], lps: list[float]) -> Completion:
        done = self.decoder.completion(row)
        return Completion(token_ids=done.token_ids, logprobs=lps[:len(done.token_ids)],
                          text=done.text, finish_reason="stop" if done.stopped else "length")


class VLLMEngine:
    """vLLM in-process (V1 engine with multiprocessing off, so a closure can reach the model).

    vLLM places the model itself (set CUDA_VISIBLE_DEVICES to pick a GPU); `device` is only
    checked. Weight updates go through the model's own `load_weights`, which takes HF names and
    fills fused qkv / gate_up parameters; the names are first checked against the HF model
    built on the meta device, so a wrong state fails with ValueError as in TransformersEngine.
    """

    def __init__(self, model: str, *, device: str = "cuda", dtype: str = "bfloat16",
                 gpu_memory_utilization: float = 0.5, seed: int = 0):
        # The multi-process engine cannot pickle tensors through collective_rpc (FIELD-NOTES).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from transformers import AutoConfig, AutoModelForCausalLM
        from vllm import LLM, SamplingParams

        from .model import BUILTIN_MODEL, builtin_dir

        path = str(builtin_dir()) if model == BUILTIN_MODEL else model
        log.info("starting vLLM for %s (asked for device %s)", path, device)
        with torch.device("meta"):
            reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        self._state_names = set(reference.state_dict())
        self._required_names = {name for name, _ in reference.named_parameters()}
        self._sampling_params = SamplingParams
        self.llm = LLM(model=path, dtype=dtype, seed=seed, enable_prefix_caching=True,
                       gpu_memory_utilization=gpu_memory_utilization,
                       logprobs_mode="processed_logprobs")
        self.tokenizer = self.llm.get_tokenizer()
        self.decoder = CompletionDecoder(self.tokenizer)  # the rule the hub scores by

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        check_names(self._state_names, self._required_names, named_tensors)
        weights = list(named_tensors.items())

        def load(worker: Any) -> None:  # runs in the worker; `worker` is vLLM's Worker
            worker.model_runner.model.load_weights(weights)

        self.llm.collective_rpc(load)
        self.llm.reset_prefix_cache()  # else KV cached under the old weights is served again

    def generate(self, prompt_ids: list[int], n: int, *, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int) -> list[Completion]:
        # top_k is left at vLLM's default (off); logprobs=0 returns the sampled token's logprob.
        params = self._sampling_params(n=n, temperature=temperature, top_p=top_p,
                                       max_tokens=max_new_tokens, logprobs=0, seed=seed)
        (request,) = self.llm.generate([{"prompt_token_ids": list(prompt_ids)}], params,
                                       use_tqdm=False)
        completions = []
        for out in request.outputs:
            # Ends with EOS when finish_reason is "stop"; cut by the hub's rule all the same.
            done = self.decoder.completion(out.token_ids)
            ids = done.token_ids
            lps = [step[tok].logprob for tok, step in zip(ids, out.logprobs)]
            reason = "stop" if out.finish_reason == "stop" else "length"
            completions.append(Completion(ids, lps, done.text, reason))
        return completions


def make_engine(kind: str, model: str, device: str) -> Engine:
    """The engine `kind` ("transformers" | "vllm") serving `model` on `device`."""
    if kind == "transformers":
        return TransformersEngine(model, device=device)
    if kind == "vllm":
        return VLLMEngine(model, device=device)
    raise ValueError(f"unknown engine {kind!r}; expected one of {', '.join(ENGINES)}")

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

import hashlib
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from echo2p2p.completions import CompletionDecoder
from echo2p2p.messages import ENGINES
from . import vllm_setup
from .model import load_policy
from .sampling import check_state, copy_checked, forward_cached, nucleus_logprobs, state_shapes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]
    logprobs: list[float]  # one per token id, of the sampled token, <= 0
    text: str
    finish_reason: str  # "stop" (EOS sampled, and kept in token_ids) | "length"


class Engine(Protocol):
    """What a peer drives: sampling and weight swaps (`TransformersEngine`, `VLLMEngine`)."""

    tokenizer: Any  # Any: a transformers tokenizer, or vLLM's wrapper of one
    decoder: CompletionDecoder  # the completion rule the hub scores by

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
        self._intact = True  # False while (or after a failure of) a copy into the model
        self._shapes = state_shapes(self.model)  # what every update is checked against

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """All or nothing, as VLLMEngine's: a bad state is refused before any copy, and after a
        copy that fails half-way `generate` refuses until a complete state is loaded."""
        check_state(*self._shapes, named_tensors)
        self._intact = False
        copy_checked(self.model, named_tensors)
        self._intact = True

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], n: int, *, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int) -> list[Completion]:
        refuse_if_mixed(self._intact)
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

    vLLM places the model itself (set CUDA_VISIBLE_DEVICES to pick a GPU); `device` picks the
    platform's defaults: on "cpu" float32 and a 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE), on a GPU
    bfloat16. A directory without weight files starts on vLLM's dummy weights: the peer loads the
    real ones, as every later version, with `load_weights`.

    Weight updates are all or nothing. The state is checked (names and shapes, against the HF
    model built on the meta device) before anything is copied; the worker's `reload_weights`
    (the model's own `load_weights` on vLLM before 0.2x) then takes the HF names, fills fused
    qkv / gate_up parameters and redoes the kernels' weight processing (the CPU backend
    repacks linear weights, leaving the plain parameters empty); then the prefix cache is
    reset, so no KV computed under the old weights is ever served again. Should the copy itself
    fail half-way, `generate` refuses (RuntimeError) until a complete state is loaded: a mixed
    model never serves. Callers serialise `generate` and `load_weights` (the peer's engine lock),
    so a version swap waits for the generation in flight, which finishes on the old version.

    Sampling: each of the n samples is its own request with its own seed, derived from `seed`
    (one request with n > 1 and a seed samples n identical completions in vLLM 0.32). Logprobs
    are vLLM's "processed_logprobs": those of the distribution sampled, after temperature and
    top-p, as `nucleus_logprobs` computes them.
    """

    def __init__(self, model: str, *, device: str = "cuda", dtype: str = "auto", seed: int = 0,
                 gpu_memory_utilization: float = 0.5, max_model_len: int | None = None,
                 cache_dir: str | Path | None = None, threads: int = 0):
        """`cache_dir`: vLLM's compile cache (VLLM_CACHE_ROOT; None: vLLM's default), reused by
        the next start; `threads`: torch threads on a CPU (0: vLLM's default). Both are set in
        the environment before vLLM is imported (`vllm_setup.prepare`)."""
        # The multi-process engine cannot pickle tensors through collective_rpc (FIELD-NOTES).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        on_cpu = device == "cpu"
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
        vllm_setup.prepare(cache_dir=cache_dir, threads=threads, on_cpu=on_cpu)
        from transformers import AutoConfig, AutoModelForCausalLM
        from vllm import LLM, SamplingParams

        from .model import architecture_only, model_source

        path = model_source(model)
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            self._shapes = state_shapes(AutoModelForCausalLM.from_config(config))
        # Before vLLM logs anything: it warns of harmless things a volunteer cannot act on.
        self._notices = vllm_setup.HarmlessNotices(
            tied=bool(getattr(config, "tie_word_embeddings", False))).install()
        if max_model_len is None and on_cpu:  # the KV cache must hold one whole sequence
            max_model_len = min(config.max_position_embeddings, CPU_MAX_MODEL_LEN)
        load_format = "dummy" if architecture_only(path) else "auto"
        vllm_setup.announce_start(path, device)
        started = time.monotonic()
        self._sampling_params = SamplingParams
        self.llm = LLM(model=path, dtype=("float32" if on_cpu else "bfloat16") if dtype == "auto"
                       else dtype, seed=seed, enable_prefix_caching=True,
                       gpu_memory_utilization=gpu_memory_utilization, load_format=load_format,
                       max_model_len=max_model_len, logprobs_mode="processed_logprobs")
        log.info("vLLM started in %.0f s (weights: %s, %d torch threads; compiled graphs: %d "
                 "loaded from the cache, %d compiled)", time.monotonic() - started, load_format,
                 torch.get_num_threads(), *vllm_setup.compiled_graphs())
        self.tokenizer = self.llm.get_tokenizer()
        self.decoder = CompletionDecoder(self.tokenizer)  # the rule the hub scores by
        self._intact = True  # False while (or after a failure of) a copy into the model

    def load_weights(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        check_state(*self._shapes, named_tensors)  # before anything is copied
        weights = list(named_tensors.items())

        def load(worker: Any) -> None:  # runs in the worker; `worker` is vLLM's Worker
            if hasattr(worker, "reload_weights"):  # also redoes the kernels' weight processing
                worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
                _reprocess_tied_head(worker.model_runner.model)
            else:  # older vLLM: the model's own loader, in place (GPU kernels repack nothing)
                worker.model_runner.model.load_weights(weights)

        self._intact = False
        self.llm.collective_rpc(load)
        self.llm.reset_prefix_cache()  # else KV cached under the old weights is served again
        self._intact = True

    def generate(self, prompt_ids: list[int], n: int, *, temperature: float, top_p: float,
                 max_new_tokens: int, seed: int) -> list[Completion]:
        refuse_if_mixed(self._intact)
        # top_k is left at vLLM's default (off); logprobs=0 returns the sampled token's logprob.
        params = [self._sampling_params(temperature=temperature, top_p=top_p, logprobs=0,
                                        max_tokens=max_new_tokens, seed=sample_seed(seed, i))
                  for i in range(n)]
        prompts = [{"prompt_token_ids": list(prompt_ids)}] * n
        completions = []
        for request in self.llm.generate(prompts, params, use_tqdm=False):
            (out,) = request.outputs
            # Ends with EOS when finish_reason is "stop"; cut by the hub's rule all the same.
            done = self.decoder.completion(out.token_ids)
            ids = done.token_ids
            lps = [step[tok].logprob for tok, step in zip(ids, out.logprobs)]
            reason = "stop" if out.finish_reason == "stop" else "length"
            completions.append(Completion(ids, lps, done.text, reason))
        return completions


def _reprocess_tied_head(model: torch.nn.Module) -> None:
    """Redo a tied lm_head's weight processing after a reload. vLLM's layerwise reload redoes
    only the embedding's (its documented limitation), and on CPU the head computes logits from
    a packed copy made at load time: without this it would go on scoring with the old weights."""
    head = getattr(model, "lm_head", None)
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    method = getattr(head, "quant_method", None)
    if method is not None and embedding is not None and head.weight is embedding.weight:
        method.process_weights_after_loading(head)


def refuse_if_mixed(intact: bool) -> None:
    """RuntimeError unless the engine's weights are one whole version."""
    if not intact:
        raise RuntimeError("the last weight update failed half-way: load a complete version "
                           "before generating")


CPU_MAX_MODEL_LEN = 2048  # tokens a CPU engine's sequence may reach (prompt + completion)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a call with `seed`: far apart for neighbouring seeds, which
    a peer's successive calls use."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # a non-negative int64


def make_engine(kind: str, model: str, device: str, *, dtype: str = "",
                cache_dir: str | Path | None = None, threads: int = 0) -> Engine:
    """The engine `kind` ("transformers" | "vllm") serving `model` on `device` in `dtype` (a
    torch name; "": the engine's default); for vllm, `cache_dir` keeps its compile cache and
    `threads` (>0) sets its CPU threads."""
    if kind == "transformers":
        return TransformersEngine(model, device=device, dtype=getattr(torch, dtype or "float32"))
    if kind == "vllm":
        return VLLMEngine(model, device=device, dtype=dtype or "auto", cache_dir=cache_dir,
                          threads=threads)
    raise ValueError(f"unknown engine {kind!r}; expected one of {', '.join(ENGINES)}")

"""What a learner of P parameters on W ranks costs: memory per rank, step time, publication time.

Pure arithmetic for `echo2-hub plan` and for the hub's footprint predicted at start
(`hub_footprint`: its RAM and disk for a model and config, `*_within`: micro-batches, checkpoint
cadence and catch-up depth within their budgets); the constants are measured by
`bench/learner_memory.py` (memory, step speed-up) and `bench/realsize.py` (publication stages),
on CPU, and are stated where they are defined; `bench/hub_footprint.py` checks the prediction
against a real model's step, `bench/demo_footprint.py` against a real hub and demo (its peers:
`peer_bytes`, by engine). Bytes per parameter of the trained state (FSDP2 shards all of it):
fp32 master weights 4, gradients 4, AdamW's two moments 8: 16 P / W per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STATE_BYTES_PER_PARAM = 16  # fp32 weights + fp32 gradients + AdamW exp_avg + exp_avg_sq
ACTIVATION_BYTES = 121.0
"""Bytes autograd keeps per token, per unit of hidden size, per decoder layer, for the backward
(fp32, no checkpointing; measured 120.6 on the 0.6B shape, 116.5 on tiny). With checkpointing,
one layer's worth while it is recomputed plus each layer's input (4 bytes; measured 4.4)."""
LOGIT_BYTES_PER_TOKEN_VOCAB = 12.0
"""fp32 logits (measured 0.99 x T x vocab x 4 kept), their logsumexp and gradient in flight."""
RUNTIME_BYTES = 0.6e9
"""A hub process before any model: python, torch, transformers, the server (measured ~0.5 GB)."""
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights + AdamW's two moments (gradients are not saved)
ALLOCATOR_SLACK = 0.5
"""Share of a micro-batch's bytes the allocator keeps beyond it: activations under glibc's
(dynamic, up to 32 MB) mmap threshold come from the arena of whichever worker thread ran the
step, and a freed arena is not given back while the next step, a spot-check or an evaluation
allocates in another. Taken from the issue-45 runs of SmolLM2-135M (peaks 8.2-9.4 GB where the
parts below sum to about 7.6 without it)."""
SPOT_BYTES_PER_TOKEN_VOCAB = 8.0  # a spot-check's no-grad forward: fp32 logits and log-softmax
RESUME_BYTES_PER_PARAM = 12.0
"""A checkpoint read back while the model and optimizer are resident (torch.distributed.checkpoint
reads each tensor's bytes before copying them in: 12 P at most; the hub of a resumed demo of
issue 45 peaked 3-4 GB above the first run's, allocator slack included)."""
WORKER_BYTES = 0.17e9  # a reward worker process: Python and the task's verifier (measured 0.17)
PEER_RUNTIME_BYTES = 0.6e9  # a transformers peer before its model: python, torch, transformers
PEER_BYTES_PER_PARAM = 16.0
"""A transformers peer's model (fp32, 4 P), the version it holds and the one it decodes (bf16
streams, 2 P each), its chunks and generation: SmolLM2-135M peers measured 1.95 GB after v0 and
2.5-3.1 GB later in the issue-45 runs."""
VLLM_RUNTIME_BYTES = 3.0e9  # vLLM's CPU engine, its compiled graphs and worker, before weights
VLLM_KV_CACHE_BYTES = 2 ** 30  # VLLM_CPU_KVCACHE_SPACE=1, as the demo sets it
VLLM_BYTES_PER_PARAM = 10.0  # its weights, the versions it holds and swaps in (5.5 GB measured
# on SmolLM2-135M in issue 45; not re-measured here)
STREAM_BYTES_PER_PARAM = 2  # a published version's raw stream, bf16

FULL_CODING_BPS = 230e6  # raw bytes/s per core: zstd + blake2b of a full version (realsize.py)
DELTA_CODING_BPS = 390e6  # raw bytes/s per core: the delta codec against the previous version
CAST_BPS = 2.3e9  # bf16 bytes out per second on one core: the cast of the gathered tensors


@dataclass(frozen=True)
class ModelShape:
    """What the sizes depend on; hidden, layers, vocab 0 when only P is known."""

    params: int
    largest: int = 0  # parameters of the largest tensor (the embedding, usually)
    hidden: int = 0
    layers: int = 0
    vocab: int = 0

    @classmethod
    def of(cls, model) -> ModelShape:
        """The shape of a transformers causal LM (its `config` and parameters; a model on the
        meta device will do)."""
        sizes = [p.numel() for p in model.parameters()]
        config = model.config
        return cls(sum(sizes), max(sizes, default=0), config.hidden_size,
                   config.num_hidden_layers, config.vocab_size)


def memory_per_rank_bytes(shape: ModelShape, ranks: int, micro_tokens: int,
                          checkpointing: bool = False, *, kl: bool = False) -> float:
    """Peak bytes one learner rank holds in a step: its shard of the trained state (and of the
    KL reference), one gathered tensor in fp32, and one micro-batch's activations and logits."""
    state = STATE_BYTES_PER_PARAM * shape.params / ranks
    reference = 4 * shape.params / ranks if kl else 0.0
    gathered = 4 * shape.largest
    kept_layers = 1 if checkpointing else shape.layers
    activations = micro_tokens * shape.hidden * (ACTIVATION_BYTES * kept_layers
                                                 + (4 * shape.layers if checkpointing else 0))
    logits = micro_tokens * shape.vocab * LOGIT_BYTES_PER_TOKEN_VOCAB
    return state + reference + gathered + activations + logits


def least_ranks(shape: ModelShape, memory_bytes: float, micro_tokens: int,
                checkpointing: bool = False, *, kl: bool = False, most: int = 4096) -> int | None:
    """The fewest ranks whose per-rank peak fits in `memory_bytes` (None: none up to `most`)."""
    for ranks in (2 ** k for k in range(int(math.log2(most)) + 1)):
        if memory_per_rank_bytes(shape, ranks, micro_tokens, checkpointing, kl=kl) <= memory_bytes:
            return ranks
    return None


def train_step_s(measured_s: float, measured_ranks: int, ranks: int, efficiency: float) -> float:
    """T_train on `ranks` ranks from a step measured on `measured_ranks`: work splits evenly,
    each change of the rank count by a factor f costs (or saves) efficiency^log2(f) (FSDP's
    gathers and reductions do not shrink with W)."""
    factor = ranks / measured_ranks
    return measured_s / factor / efficiency ** math.log2(factor)


def publish_s(params: int, ranks: int, hub_cores: int, interconnect_bps: float,
              *, delta: bool = True) -> float:
    """Seconds from a step's end until its version can be announced: every tensor gathered to
    rank 0 ((W - 1) / W of 4P bytes over the interconnect, none on one rank), cast to bf16, and
    both snapshots coded on `hub_cores` cores (full, and the delta unless an anchor)."""
    gather = 4 * params * (ranks - 1) / ranks * 8 / interconnect_bps if ranks > 1 else 0.0
    cast = 2 * params / CAST_BPS
    coding = 2 * params / (FULL_CODING_BPS * hub_cores)
    if delta:
        coding += 2 * params / (DELTA_CODING_BPS * hub_cores)
    return gather + cast + coding


def micro_batch_bytes_per_token(shape: ModelShape, checkpointing: bool = False) -> float:
    """Bytes one padded token of a micro-batch costs in a learner step: its activations kept
    for the backward (all layers, or one plus each layer's input with checkpointing) and its
    fp32 logits over the vocabulary (`LOGIT_BYTES_PER_TOKEN_VOCAB`)."""
    layers = (ACTIVATION_BYTES + 4 * shape.layers if checkpointing
              else ACTIVATION_BYTES * shape.layers)
    return shape.hidden * layers + shape.vocab * LOGIT_BYTES_PER_TOKEN_VOCAB


def micro_tokens_within(shape: ModelShape, budget_bytes: float, most: int,
                        checkpointing: bool = False) -> int:
    """Padded tokens per micro-batch: at most `most`, and few enough that their activations and
    logits fit in `budget_bytes` (at least 1: a longer sample still goes alone)."""
    per_token = micro_batch_bytes_per_token(shape, checkpointing)
    return max(1, min(most, int(budget_bytes // per_token))) if per_token > 0 else most


def checkpoint_every_within(params: int, every: int, budget_bytes: float) -> int:
    """Versions between checkpoints: `every`, raised so that checkpoints (12 P bytes each)
    write at most about `budget_bytes` per published version on average (0: no budget)."""
    if every == 0 or budget_bytes <= 0:
        return every
    return max(every, math.ceil(CHECKPOINT_BYTES_PER_PARAM * params / budget_bytes))


def catch_up_versions_within(params: int, most: int, max_lag: int, budget_bytes: float) -> int:
    """How far back a laggard still gets a delta: `most`, lowered so that the streams kept for
    it (2 P bytes each) fit in `budget_bytes` (0: no budget), but never below max_lag + 2 (a
    peer just past the staleness window still gets one); beyond, it takes the newest in full."""
    if budget_bytes <= 0:
        return most
    fit = int(budget_bytes // max(STREAM_BYTES_PER_PARAM * params, 1)) - 1
    return min(most, max(max_lag + 2, fit))


@dataclass(frozen=True)
class Footprint:
    """The hub's predicted peak RAM and disk, in bytes, and what they are made of."""

    ram_bytes: float
    disk_bytes: float
    ram_parts: dict[str, float]
    disk_parts: dict[str, float]
    disk_per_version_bytes: float  # written per published version, on average

    def line(self) -> str:
        """One line for the hub's log."""
        gb = 1e9
        ram = ", ".join(f"{k} {v / gb:.2f}" for k, v in self.ram_parts.items() if v)
        disk = ", ".join(f"{k} {v / gb:.2f}" for k, v in self.disk_parts.items() if v)
        return (f"predicted hub footprint: RAM {self.ram_bytes / gb:.1f} GB ({ram}), disk "
                f"{self.disk_bytes / gb:.1f} GB ({disk}), about {self.disk_per_version_bytes / gb:.2f} "
                f"GB written per version")


def hub_footprint(shape: ModelShape, micro_tokens: int, *, checkpointing: bool = False,
                  kl: bool = False, spot_check: bool = True, kept_streams: int = 1,
                  kept_versions: int = 3, checkpoint_every: int = 1, score_workers: int = 1,
                  spot_tokens: int = 0, read_streams: int = 1, resumed: bool = False) -> Footprint:
    """The peak RAM and disk of a hub training `shape` on one learner rank (this process and
    its scoring workers). RAM: the learner (`memory_per_rank_bytes`: 16 P of state, one
    micro-batch of `micro_tokens`) and the allocator's slack over that micro-batch; the
    spot-checker's fp32 copy (4 P) and one group's forward of `spot_tokens` tokens; the version
    being published (its bf16 stream and delta, 2 x 2 P) and the `read_streams` kept streams
    whose mapped pages the hub reads back (2 P each: the spot-checker's S + 1 versions, the
    next delta's base); `resumed`, the checkpoint loaded while the model is resident; the
    runtime, and `score_workers` reward workers plus the evaluation's. Disk: the kept streams (2 P each), the served versions' chunk files (at
    most 2 x 2 P each: full and delta) and, with checkpoints (`checkpoint_every` > 0), two
    checkpoints of 12 P while a new one is written before the old goes."""
    p = shape.params
    micro = (memory_per_rank_bytes(shape, 1, micro_tokens, checkpointing, kl=kl)
             - STATE_BYTES_PER_PARAM * p - (4 * p if kl else 0) - 4 * shape.largest)
    spot = 4 * p + spot_tokens * shape.vocab * SPOT_BYTES_PER_TOKEN_VOCAB if spot_check else 0.0
    ram = {"learner state": STATE_BYTES_PER_PARAM * p + (4 * p if kl else 0),
           "micro-batch": micro, "allocator slack": ALLOCATOR_SLACK * micro,
           "spot-checker": spot, "publication": 2 * STREAM_BYTES_PER_PARAM * p,
           "read streams": read_streams * STREAM_BYTES_PER_PARAM * p,
           "resume load": RESUME_BYTES_PER_PARAM * p if resumed else 0.0,
           "runtime": RUNTIME_BYTES, "scoring workers": (score_workers + 1) * WORKER_BYTES}
    stream = STREAM_BYTES_PER_PARAM * p
    checkpoint = CHECKPOINT_BYTES_PER_PARAM * p
    disk = {"checkpoints": 2 * checkpoint if checkpoint_every else 0.0,
            "streams": kept_streams * stream, "chunks": kept_versions * 2 * stream}
    per_version = 2 * stream + (checkpoint / checkpoint_every if checkpoint_every else 0.0)
    return Footprint(sum(ram.values()), sum(disk.values()), ram, disk, per_version)


def peer_bytes(shape: ModelShape, engine: str) -> float:
    """RAM of one local peer process on this machine (the demo's), by engine: its runtime, its
    model and the versions it holds and decodes (`PEER_BYTES_PER_PARAM`), and for vLLM its own
    runtime and KV cache (`VLLM_CPU_KVCACHE_SPACE`, 1 GiB in the demo)."""
    if engine == "vllm":
        return VLLM_RUNTIME_BYTES + VLLM_KV_CACHE_BYTES + VLLM_BYTES_PER_PARAM * shape.params
    return PEER_RUNTIME_BYTES + PEER_BYTES_PER_PARAM * shape.params


def demo_line(hub: Footprint, shape: ModelShape, peers: int, engine: str) -> str:
    """The demo's predicted RAM (hub and its local peers) in one line for the log."""
    each = peer_bytes(shape, engine)
    return (f"predicted demo footprint: RAM {(hub.ram_bytes + peers * each) / 1e9:.1f} GB (hub "
            f"{hub.ram_bytes / 1e9:.2f}, {peers} local {engine} peer(s) {each / 1e9:.2f} each)")

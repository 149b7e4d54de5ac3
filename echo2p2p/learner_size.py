"""What a learner of P parameters on W ranks costs: memory per rank, step time, publication time.

Pure arithmetic for `echo2-hub plan`; the constants are measured by `bench/learner_memory.py`
(memory, step speed-up) and `bench/realsize.py` (publication stages), on CPU, and are stated
where they are defined. Bytes per parameter of the trained state (FSDP2 shards all of it):
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


def memory_per_rank_bytes(shape: ModelShape, ranks: int, micro_tokens: int,
                          checkpointing: bool = False, kl: bool = False) -> float:
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
                checkpointing: bool = False, kl: bool = False, most: int = 4096) -> int | None:
    """The fewest ranks whose per-rank peak fits in `memory_bytes` (None: none up to `most`)."""
    for ranks in (2 ** k for k in range(int(math.log2(most)) + 1)):
        if memory_per_rank_bytes(shape, ranks, micro_tokens, checkpointing, kl) <= memory_bytes:
            return ranks
    return None


def train_step_s(measured_s: float, measured_ranks: int, ranks: int, efficiency: float) -> float:
    """T_train on `ranks` ranks from a step measured on `measured_ranks`: work splits evenly,
    each change of the rank count by a factor f costs (or saves) efficiency^log2(f) (FSDP's
    gathers and reductions do not shrink with W)."""
    factor = ranks / measured_ranks
    return measured_s / factor / efficiency ** math.log2(factor)


def publish_s(params: int, ranks: int, hub_cores: int, interconnect_bps: float,
              delta: bool = True) -> float:
    """Seconds from a step's end until its version can be announced: every tensor gathered to
    rank 0 ((W - 1) / W of 4P bytes over the interconnect, none on one rank), cast to bf16, and
    both snapshots coded on `hub_cores` cores (full, and the delta unless an anchor)."""
    gather = 4 * params * (ranks - 1) / ranks * 8 / interconnect_bps if ranks > 1 else 0.0
    cast = 2 * params / CAST_BPS
    coding = 2 * params / (FULL_CODING_BPS * hub_cores)
    if delta:
        coding += 2 * params / (DELTA_CODING_BPS * hub_cores)
    return gather + cast + coding

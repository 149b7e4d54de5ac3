"""The learner on several ranks: PyTorch's process group, FSDP2 sharding, and rank 0 leading.

Launched the way PyTorch jobs are (`torchrun --nproc-per-node N -m echo2p2p.hub.cli serve …`,
multi-node through torchrun's rendezvous; `echo2-hub serve --nproc-per-node N` re-executes
itself under it). Every rank loads the same policy; `Ranks.shard` gives every rank rank 0's
initial weights, then `fully_shard`s each decoder layer and the whole model over a 1-D
`DeviceMesh`, so parameters, gradients and AdamW state are split W ways.

Rank 0 runs the hub and the learner loop. Its learner is a `Leader`: each call (a step, a
publication, an evaluation, a checkpoint) is first sent to the other ranks over a control
group that never times out (they may wait hours for the next batch), then made by every rank
together, so all of them run the same collectives in the same order. The other ranks run
`follow`: receive a call, make it, until rank 0 says stop. A rank that dies makes the
collectives of the others fail within `learner_timeout_s` (torchrun also stops the job); rank
0 raises `RankFailure`, which says how to resume from the last checkpoint.

Checked before any training, with one message each: a rank count that does not divide the
batch, a rank whose config differs from rank 0's (the differing fields are named), a rank that
cannot reach the rendezvous within `learner_timeout_s`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from echo2p2p.errors import ConfigError, Echo2Error

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PreTrainedTokenizerBase

    from echo2p2p.tasks import Problem

    from ..config import HubConfig

log = logging.getLogger(__name__)

FOREVER = timedelta(days=365)  # the control group: waiting for rank 0's next call is no fault


class RankFailure(Echo2Error):
    """Another learner rank failed or cannot be reached: the run stops (resume it)."""


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun sets them; (0, 1, 0) outside it."""
    try:
        return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                int(os.environ.get("LOCAL_RANK", 0)))
    except ValueError as e:
        raise ConfigError("WORLD_SIZE", f"RANK, WORLD_SIZE and LOCAL_RANK must be integers "
                                        f"({e}): launch the ranks with torchrun") from None


def check_world(cfg: HubConfig, world: int) -> None:
    """What the config must satisfy for `world` ranks to split every batch evenly."""
    if cfg.grpo.prompts_per_step % world:
        raise ConfigError("prompts_per_step", f"{cfg.grpo.prompts_per_step} groups per step do not "
                          f"split over {world} learner ranks: make it a multiple of {world}, "
                          f"or launch a rank count that divides it")


@dataclass
class Ranks:
    """This process's place among the learner's ranks, and the collectives they share."""

    rank: int
    world: int
    device: torch.device
    mesh: DeviceMesh
    control: dist.ProcessGroup  # gloo, with no deadline, for rank 0's calls

    @classmethod
    def from_env(cls, cfg: HubConfig) -> Ranks | None:
        """Join the process group torchrun describes, or None when this is a single process."""
        rank, world, local_rank = world_from_env()
        if world == 1:
            return None
        check_world(cfg, world)
        device = torch.device(cfg.learner.device)
        if device.type == "cuda":  # one GPU per rank on each node
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=cfg.learner.learner_timeout_s),
                                    device_id=device if backend == "nccl" else None)
            control = dist.new_group(backend="gloo", timeout=FOREVER)
        except (RuntimeError, TimeoutError, ValueError) as e:  # DistStoreError is a RuntimeError
            raise ConfigError("learner_timeout_s", f"learner rank {rank} of {world} could not "
                              f"reach the rendezvous at {where} within "
                              f"{cfg.learner.learner_timeout_s:g} s ({type(e).__name__}): start "
                              f"every rank with the same "
                              f"--master-addr/--master-port (or --rdzv-endpoint) and check that "
                              f"rank 0's port is open") from None
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
        ranks = cls(rank, world, device, mesh, control)
        log.info("learner rank %d of %d on %s (%s)", rank, world, device, backend)
        return ranks

    def agree(self, config: dict[str, Any]) -> None:
        """Raise ConfigError on every rank unless all ranks resolved the same config."""
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, config, group=self.control)
        differ = sorted({k for other in everyone for k in set(config) | set(other)
                         if other.get(k) != everyone[0].get(k)})
        if differ:
            ranks = [r for r, other in enumerate(everyone) if other != everyone[0]]
            raise ConfigError(differ[0], f"learner ranks {ranks} resolved a config other than "
                              f"rank 0's in {', '.join(differ)}: give every rank the same flags "
                              f"and config file")

    def shard(self, model: torch.nn.Module, precision: str = "fp32") -> None:
        """Each decoder layer and the model sharded in place (`fully_shard`), holding rank 0's
        weights on every rank. Rank 0 passes its loaded model, the others the architecture on
        the meta device (`load_policy(weights=False)`): only rank 0 ever holds a whole copy,
        and each of the others receives its shards tensor by tensor. With precision bf16,
        compute in bf16 over fp32 master weights and fp32 gradient reductions."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        whole = model.state_dict() if self.rank == 0 else {}  # alive until it is sent
        policy = MixedPrecisionPolicy()
        if precision == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=self.mesh, mp_policy=policy)
        fully_shard(model, mesh=self.mesh, mp_policy=policy)
        if self.rank:  # meta tensors become memory, filled just below
            model.to_empty(device=self.device)
        else:
            model.to(self.device)
        set_model_state_dict(model, whole, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        with torch.no_grad():  # buffers outside the state dict (rotary frequencies) too
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)
        del whole
        _release_freed_heap()

    def gather_to_first(self, obj: Any) -> list[Any]:  # anything picklable
        """Every rank's `obj`, on rank 0 (others get [])."""
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out or []

    def all_sum(self, values: list[float], largest: float) -> tuple[list[float], float]:
        """`values` summed over the ranks, and the largest `largest`."""
        t = torch.tensor([*values, largest], dtype=torch.float64, device=self.device)
        top = t[-1:].clone()
        dist.all_reduce(t)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return t[:-1].tolist(), float(top.item())

    def all_sum_max(self, sums: torch.Tensor, maxes: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`sums` summed and `maxes` maximised elementwise over the ranks (CPU tensors back)."""
        sums, maxes = sums.to(self.device), maxes.to(self.device)
        dist.all_reduce(sums)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        return sums.cpu(), maxes.cpu()

    def send(self, call: tuple) -> None:
        """Rank 0: the call every other rank makes next (`follow`)."""
        dist.broadcast_object_list([call], src=0, group=self.control)

    def receive(self) -> tuple:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _release_freed_heap() -> None:
    """Hand the whole model's freed memory back to the OS (glibc keeps freed heap otherwise,
    and rank 0's resident memory would stay a full copy above its shard)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP shards one by one (and activation checkpointing wraps)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ConfigError("model", f"{type(model).__name__} has no .model.layers to shard: "
                                   f"sharded learners support decoder-only HF models")
    return list(layers)


class Leader:
    """Rank 0's learner: every call goes to the other ranks first, then all make it together.
    Attributes it does not wrap (`model`, `vocab_size`, ...) are the learner's own."""

    def __init__(self, learner: Any, ranks: Ranks):  # Any: a `Learner` (which imports Ranks)
        self.learner, self.ranks = learner, ranks

    def __getattr__(self, name: str) -> Any:  # the learner's attribute, whatever it is
        return getattr(self.learner, name)

    def _lead(self, op: str, *args: Any) -> Callable[..., Any]:
        try:
            self.ranks.send((op, *args))
        except RuntimeError as e:
            raise RankFailure(_stopped(op, e)) from e
        return getattr(self.learner, op)

    def step(self, groups: list) -> Any:  # a `StepStats` (learner.py imports this module)
        return _guard("step", self._lead("step", list(groups)), groups)

    def iter_weights(self, dtype: torch.dtype):
        gen = self._lead("iter_weights", dtype)(dtype)
        try:
            yield from gen
        except RuntimeError as e:
            raise RankFailure(_stopped("a publication", e)) from e

    def evaluate(self, tokenizer: PreTrainedTokenizerBase, problems: list,
                 score: Callable[[list[tuple[Problem, str]]], list[float]] | None,
                 **kw: Any) -> float:
        return _guard("an evaluation", self._lead("evaluate", list(problems), kw),
                      tokenizer, problems, score, **kw)

    def save(self, where: Path) -> None:
        _guard("a checkpoint", self._lead("save", str(where)), where)

    def load(self, where: Path) -> None:
        _guard("a resume", self._lead("load", str(where)), where)

    def close(self) -> None:
        """Tell the other ranks the run is over (they return from `follow`); a rank that is
        gone already hears nothing, and that is no new error."""
        with contextlib.suppress(RuntimeError):
            self.ranks.send(("stop",))


def _guard(what: str, call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    try:
        return call(*args, **kw)
    except RuntimeError as e:  # gloo/NCCL: a peer rank closed, or a collective timed out
        raise RankFailure(_stopped(what, e)) from e


def _stopped(what: str, e: BaseException) -> str:
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return (f"a learner rank failed or stopped answering during {what} ({first}); the run "
            f"stopped. Restart every rank with `echo2-hub serve --resume RUN_DIR` to continue "
            f"from the last checkpoint (any rank count that divides the batch)")


def follow(learner: Any, ranks: Ranks, tokenizer: PreTrainedTokenizerBase) -> None:
    # Any: a `Learner`, whose module imports this one
    """A rank other than 0: make rank 0's calls until it says stop."""
    while True:
        try:
            op, *args = ranks.receive()
        except RuntimeError as e:  # rank 0 is gone: its process ended or its node is cut off
            raise RankFailure(_stopped("the wait for rank 0's next call", e)) from e
        if op == "stop":
            return
        if op == "step":
            learner.step(args[0])
        elif op == "iter_weights":
            for _ in learner.iter_weights(args[0]):
                pass
        elif op == "evaluate":
            learner.evaluate(tokenizer, args[0], None, **args[1])
        elif op in ("save", "load"):
            getattr(learner, op)(Path(args[0]))
        else:
            raise RankFailure(f"rank 0 sent an unknown call {op!r}: are all ranks running the "
                              f"same echo2p2p version?")

"""What a vLLM engine needs set before vLLM is imported, and what it says while it starts.

vLLM reads its settings from the environment (`vllm.envs`), so `prepare` sets them in this
process before the first `import vllm` (the peer imports vLLM only to build its engine):

- `VLLM_USE_AOT_COMPILE=0`. vLLM 0.32 saves an AOT-compiled artifact of the model and loads it
  at the next start, but on torch 2.13 it never loads back ("Compiling model again due to a load
  failure ... 'function' object has no attribute 'finalize_loading'"): every start compiled
  afresh (a repeat start on SmolLM2-135M took 123 s, 44 s with this set).
- The compile cache, kept beside the peer's model files (`--model-cache`), so a peer that
  restarts finds it where it keeps the rest, and a volunteer deletes one directory to start
  clean. On a CPU vLLM 0.32 compiles with `torch.compile(backend="inductor")` directly
  (`CompilationMode.DYNAMO_TRACE_ONCE`, `vllm.platforms.cpu`), so the cache that counts is
  torch inductor's (`TORCHINDUCTOR_CACHE_DIR`, by default /tmp/torchinductor_USER: gone at a
  reboot, shared by every program); on a GPU vLLM's own (`VLLM_CACHE_ROOT`, which also keeps
  inductor's under it). Both go under `cache_dir`.
- Threads on a CPU (`--torch-threads`): `OMP_NUM_THREADS`, read by the OpenMP runtime when
  torch is first imported (so the peer calls this before that), which sets every thread's
  count, vLLM's sampling thread's too: the kernels vLLM compiles on a CPU take their thread
  count at run time (inductor's `cpp.dynamic_threads`), and vLLM's CPU worker refuses
  `torch.set_num_threads` once it started. The in-process engine binds no cores
  (`VLLM_CPU_OMP_THREADS_BIND` is read only by the multi-process executor), so two peers with
  `--torch-threads 1` share a machine's two cores.

A variable the user set is left as it is. `HarmlessNotices` drops the warnings of vLLM's that
a volunteer cannot act on (see there).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

INDUCTOR_CACHE = "inductor"  # torch inductor's cache, under the peer's vLLM cache


def prepare(*, cache_dir: str | Path | None, threads: int, on_cpu: bool) -> None:
    """Set vLLM's environment for an engine of this process (see the module docstring);
    `cache_dir` None: vLLM's and torch's default places. Call before torch and vLLM are
    imported: the variables are read when they load (vLLM's, once an engine ran, from a cache)."""
    if "vllm" in sys.modules:
        log.debug("vLLM was imported before its environment was set: it may not take effect")
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    if cache_dir is not None:
        root = Path(cache_dir).expanduser()
        os.environ.setdefault("VLLM_CACHE_ROOT", str(root))
        inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if inductor is None or torch_default_inductor_dir(inductor):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / INDUCTOR_CACHE)
    if on_cpu and threads > 0:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        import torch

        torch.set_num_threads(threads)


def torch_default_inductor_dir(path: str | None) -> bool:
    """Whether `path` is torch inductor's default cache directory (TMP/torchinductor_USER),
    which torch writes into the environment the first time it looks
    (`torch._inductor.runtime.cache_dir_utils.cache_dir`): found there, it is torch's doing, not
    the user's, and an engine with a cache of its own may replace it."""
    return path is not None and Path(path).parent == Path(tempfile.gettempdir()).resolve() \
        and Path(path).name.startswith("torchinductor_")


def announce_start(model: str, device: str) -> None:
    """Say what the start will take: a first start compiles the model (minutes on a CPU), a
    start with a compile cache loads what it can from it."""
    where = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.environ.get("VLLM_CACHE_ROOT")
    cached = where is not None and any((Path(where) / "fxgraph").glob("*/*"))
    if cached:
        log.info("starting vLLM for %s on %s: loading the compiled model from the cache in %s",
                 model, device, where)
    else:
        log.info("starting vLLM for %s on %s: the first start compiles the model (minutes on a "
                 "CPU); cached in %s for the next start", model, device,
                 where or "torch's and vLLM's default places")


def compiled_graphs() -> tuple[int, int]:
    """(graphs torch inductor loaded from its cache, graphs it compiled) in this process so far:
    what a start cost, in its own counters (vLLM logs nothing of it on a CPU)."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]


class HarmlessNotices(logging.Filter):
    """Drops the warnings vLLM 0.32 logs at every start or weight update of a healthy engine,
    which told a volunteer of faults that are none (`install` puts it on their loggers):

    - "ParallelLMHead: Failed to load weights" at each update of a model with a tied head
      (`tied`): the checkpoint names no lm_head weight (the head shares the embedding's), so the
      layerwise reload loads nothing into the head, warns, and puts back the packed copy made
      at load time, which `engines._reprocess_tied_head` then redoes from the new embedding
      (the hub's spot-checks of every rollout prove it). An untied head that fails still warns.
    - "RotaryEmbedding: Failed to load weights": its cos/sin table is computed from the config,
      never in a checkpoint; the reload puts it back as it was.
    - "CPU backend doesn't allow to use `torch.set_num_threads` ...", four times a start: vLLM's
      own start-up code asks for it; this peer's threads were set before (`prepare`).
    - "The global random seed is set to 0 ... may affect the random state of the Python process
      that launched vLLM": the engine runs in-process by design (`VLLMEngine`), and every
      request carries a seed of its own (`sample_seed`).
    """

    def __init__(self, tied: bool):
        super().__init__()
        self.dropped = {("%s: Failed to load weights", ("RotaryEmbedding",)),
                        (SET_THREADS, ())}
        if tied:
            self.dropped.add(("%s: Failed to load weights", ("ParallelLMHead",)))

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.msg, tuple(record.args or ())) not in self.dropped \
            and record.msg != GLOBAL_SEED

    def install(self) -> HarmlessNotices:
        for name in NOISY_LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def remove(self) -> None:
        for name in NOISY_LOGGERS:
            logging.getLogger(name).removeFilter(self)


SET_THREADS = ("CPU backend doesn't allow to use `torch.set_num_threads` after the thread "
               "binding, skip it.")
GLOBAL_SEED = ("The global random seed is set to %d. Since VLLM_ENABLE_V1_MULTIPROCESSING is "
               "set to False, this may affect the random state of the Python process that "
               "launched vLLM.")
NOISY_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                 "vllm.v1.worker.cpu_worker", "vllm.engine.arg_utils")

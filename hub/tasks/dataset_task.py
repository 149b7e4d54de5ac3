"""A Hugging Face dataset as the hub's task: read offline at start-up, handed to `MathTask` as
rows, or, in TRL's format (a "prompt" column: text, or conversational messages), to
`RecordsTask` as they are, every column kept for the reward functions.

`open_dataset_task(tasks)` reads `tasks.dataset` with the `datasets` library: a local .parquet,
.jsonl/.json, .csv or .arrow file (its one split is "train"), a folder of such files or one
written by `save_to_disk`, or a dataset name resolved in the local Hugging Face hub cache
(`local_files_only`: never a download). It checks the split and the field mapping against what
the dataset holds, extracts the gold answers (`echo2p2p.tasks.answers`), and builds the task; the
task itself never sees a file. Every mistake a user can make here (no `datasets`, a file that is
not there, a split or a column that does not exist, no row with an answer) is a ConfigError with
one sentence naming the fix, raised before the hub serves anything.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from echo2p2p.errors import ConfigError
from echo2p2p.tasks import MathTask, RecordsTask, problems_from_records
from echo2p2p.tasks.math import PROMPT_TEMPLATE

from ..config_sections import TasksConfig

log = logging.getLogger(__name__)

BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv",
            ".arrow": "arrow"}  # file suffix -> the `datasets` packaged builder that reads it


def open_dataset_task(tasks: TasksConfig, *, cache_dir: str | None = None
                      ) -> MathTask | RecordsTask:
    """The math task of `tasks.dataset` (see the module docstring), or, for a dataset in TRL's
    format (a "prompt" column), its rows as they are; `cache_dir`: the Hugging Face hub cache
    that dataset names resolve in (None: the default, $HF_HUB_CACHE)."""
    datasets = _import_datasets()
    splits = _read(datasets, tasks.dataset, tasks.dataset_config, cache_dir)
    if "prompt" in _split(splits, tasks, tasks.dataset_split, "dataset_split").column_names:
        return _prompt_rows(splits, tasks)
    train = _rows(splits, tasks, tasks.dataset_split, "dataset_split")
    held_out = (_rows(splits, tasks, tasks.dataset_eval_split, "dataset_eval_split")
                if tasks.dataset_eval_split else None)
    # the split is the task's own (the run's seed is not even given): it must not move the held-out set
    task = MathTask(train, eval_size=tasks.eval_problems, held_out=held_out)
    log.info("dataset %s: %d problems to train on, %d held out", tasks.dataset,
             len(task.problems("train")), len(task.problems("eval")))
    return task


def _import_datasets() -> types.ModuleType:
    try:
        import datasets
    except ImportError:
        raise ConfigError("dataset", "reading a dataset needs the `datasets` library: pip "
                                     "install 'echo2p2p[data]'") from None
    datasets.disable_progress_bars()  # one log line per dataset, not a bar per file
    return datasets


def _read(datasets: types.ModuleType, source: str, config: str, cache_dir: str | None
          ) -> Mapping[str, Any]:
    """The splits of `source` by name (a DatasetDict, or {"train": Dataset})."""
    path = Path(source).expanduser()
    try:
        if path.is_file():
            builder = BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise ConfigError("dataset", f"{source!r} is not a file `datasets` reads here: "
                                  f"give a {', '.join(BUILDERS)} file, or a folder of them")
            return datasets.load_dataset(builder, data_files={"train": str(path)})
        if path.is_dir():
            if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
                loaded = datasets.load_from_disk(str(path))  # written by save_to_disk
                return loaded if isinstance(loaded, Mapping) else {"train": loaded}
            return datasets.load_dataset(str(path), config or None)
        if path.suffix.lower() in BUILDERS or source.startswith((".", "/", "~")):
            raise ConfigError("dataset", f"{source!r}: no such file or folder; give the path of "
                                         f"a dataset file on this machine")
        return datasets.load_dataset(_cached_snapshot(source, cache_dir), config or None)
    except ConfigError:
        raise
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("dataset", f"cannot read {source!r} ({first}); check that it is a "
                                     f"dataset and, if it has several, set dataset_config") from None


def _cached_snapshot(name: str, cache_dir: str | None) -> str:
    """The folder of dataset `name` in the local Hugging Face hub cache, without the network."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, repo_type="dataset", local_files_only=True,
                                 cache_dir=cache_dir)
    except (OSError, ValueError):  # LocalEntryNotFoundError, HFValidationError
        raise ConfigError("dataset", f"{name!r} is not a file or folder here, nor a dataset in "
                          f"the local Hugging Face cache: fetch it once where there is a network "
                          f"(`hf download {name} --repo-type dataset`), or point dataset at a "
                          f"parquet, JSONL or arrow file") from None


# `-> Any`: a `datasets.Dataset` (the library is imported only when a dataset is read).
def _split(splits: Mapping[str, Any], tasks: TasksConfig, split: str, field: str) -> Any:
    """Split `split`; ConfigError naming `field` if it is not there."""
    if split not in splits:
        raise ConfigError(field, f"{tasks.dataset!r} has no split {split!r}; its splits: "
                                 f"{', '.join(splits)}")
    return splits[split]


def _prompt_rows(splits: Mapping[str, Any], tasks: TasksConfig) -> RecordsTask:
    """A dataset in TRL's standard or conversational format: every row with all its columns
    (what reward functions read), the prompt text or messages; the evaluation split held out
    if one is named, else a fixed share of the rows."""
    train = _split(splits, tasks, tasks.dataset_split, "dataset_split").to_list()
    held = (_split(splits, tasks, tasks.dataset_eval_split, "dataset_eval_split").to_list()
            if tasks.dataset_eval_split else None)
    try:
        task = RecordsTask(train, eval_size=tasks.eval_problems, held_out=held)
    except ValueError as exc:
        raise ConfigError("dataset", f"{tasks.dataset}: {exc}") from None
    log.info("dataset %s (prompt column): %d rows to train on, %d held out", tasks.dataset,
             len(task.problems("train")), len(task.problems("eval")))
    return task


def _rows(splits: Mapping[str, Any], tasks: TasksConfig, split: str, field: str) -> list:
    """The problems of split `split`, its field mapping checked; ConfigError naming `field`
    (or the column field) if the split or a column is not there."""
    data = _split(splits, tasks, split, field)
    for name in ("dataset_question_field", "dataset_answer_field"):
        column = getattr(tasks, name)
        if column not in data.column_names:
            raise ConfigError(name, f"split {split!r} of {tasks.dataset!r} has no column "
                                    f"{column!r}; its columns: {', '.join(data.column_names)}")
    columns = list(dict.fromkeys((tasks.dataset_question_field, tasks.dataset_answer_field)))
    try:
        problems, skipped = problems_from_records(
            data.select_columns(columns).to_list(), question_field=tasks.dataset_question_field,
            answer_field=tasks.dataset_answer_field, answer_format=tasks.answer_format,
            template=PROMPT_TEMPLATE, id_prefix=split)
    except ValueError as e:
        raise ConfigError("answer_format", str(e)) from None
    if skipped:
        log.warning("dataset %s, split %s: %d of %d rows skipped (no question text, or no answer "
                    "in answer format %r)", tasks.dataset, split, skipped, len(data),
                    tasks.answer_format)
    return problems

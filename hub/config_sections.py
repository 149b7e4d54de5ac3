"""The sections of the hub's configuration: one frozen dataclass per concern, with its checks.

`echo2p2p.hub.config.HubConfig` holds one of each (the GRPO section is in
`echo2p2p.hub.config_grpo`); a part of the hub is given the section it reads. Each field's
docstring is its `echo2-hub serve --help` text, and `--help` shows them in these sections.
Defaults are the embedded demo: built-in tiny model, built-in addition task, CPU, offline. A
section checks its own fields (the error names the field and the fix); a rule across sections
would live on `HubConfig` (none today: every rule reads one section).

Over 400 lines: the field docstrings are the flags' reference, and each section's checks sit
under its fields; split further, a reader would look in two files for one section.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any

from echo2p2p.errors import ConfigError
from echo2p2p.policy.devices import check_device
from echo2p2p.policy.prompts import MODES as PROMPT_FORMATS
from echo2p2p.policy.prompts import PromptFormat
from echo2p2p.pool import POLICIES
from echo2p2p.relay import STRATEGIES
from echo2p2p.runtime.tcp import check_congestion
from echo2p2p.staleness import check_schedule, default_publish_every


DEFAULT_PORT = 8765
TRACKERS = ("wandb", "tensorboard")  # --report-to (echo2p2p.hub.view.experiment_trackers)


@dataclass(frozen=True)
class RunConfig:
    """The run: the policy trained, its seed and length, where it is saved."""

    model: str = "tiny"
    """Policy to train: a built-in ("tiny", "smollm2-135m"), a GGUF file (converted once,
    cached), a HF hub id, or a local model directory. The fields you do not set take a built-in
    model's preset, or for any other model an lr and max_new_tokens derived from its size
    (`--print-config` shows where each value came from)."""
    seed: int = 0
    """Seed for prompt order and per-peer sampling seeds. Not the task's train/eval split: that
    is fixed, so runs on any seed hold out the same problems (none the base was warmed up on)."""
    max_steps: int = 0
    """Stop after this many learner steps (0 = run until interrupted)."""
    run_dir: str = ""
    """Where metrics.jsonl, config.json, the signing key and checkpoints go ('' = runs/<run id>)."""
    checkpoint_every: int = 1
    """Checkpoint (weights, optimizer, leases, queued rollouts, trust) before every this many
    published versions, for `serve --resume` (0 = never). With 1 a resumed hub never rolls
    back past a version peers hold; with more, a kill costs the rollouts of the versions since
    the last checkpoint, and each checkpoint writes about 12 bytes per parameter (fp32 weights
    and AdamW moments). Raised for a big model by checkpoint_bytes_per_version."""
    checkpoint_bytes_per_version: int = 256 * 2 ** 20
    """Checkpoints write at most about this many bytes per published version on average:
    checkpoint_every is raised to ceil(12 P / this) for a model of P parameters (SmolLM2-135M:
    every 7th version; the built-in tiny model: every version). 0 = exactly checkpoint_every."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "checkpoint_every", "checkpoint_bytes_per_version"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class NetworkConfig:
    """The peers' port: where the hub listens, TLS, who may join, liveness."""

    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0 to accept peers from other machines)."""
    port: int = DEFAULT_PORT
    """TCP port for the peer websocket (ws://HOST:PORT/ws); 0 picks a free one."""
    tls_cert: str = ""
    """PEM certificate chain: serve https/wss instead of http/ws (with --tls-key)."""
    tls_key: str = ""
    """PEM private key of --tls-cert."""
    tokens: str = ""
    """Token file (`echo2-hub token create --file FILE`): only peers presenting one of its
    unrevoked tokens may join. '' = anyone may join."""
    heartbeat_s: float = 10.0
    """Seconds between heartbeats to each peer."""
    peer_timeout_s: float = 30.0
    """A peer silent this long is disconnected and its leases re-issued."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError("port", f"not a TCP port: {self.port}")
        for name in ("heartbeat_s", "peer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert" if not self.tls_cert else "tls_key",
                              "--tls-cert and --tls-key go together")


def _json_object(name: str, text: str, example: str) -> dict[str, Any]:
    """The JSON object the field `name` holds; ConfigError naming the field and an example."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(name, f"not JSON ({e.msg}): write a JSON object such as "
                                f"'{example}'") from None
    if not isinstance(value, dict):
        raise ConfigError(name, f"must be a JSON object, got {text!r}")
    return value


@dataclass(frozen=True)
class TasksConfig:
    """What to train on: a task, a dataset or an environment, its prompts and held-out set."""

    task: str = "addition"
    """Task: "addition" (built-in), a path to a JSONL file with question/answer fields, or
    "rg:<name>", a reasoning-gym generator ("rg:basic_arithmetic"; pip install
    reasoning-gym), scored by the generator (leave it when --dataset names the task)."""
    task_args: str = ""
    """JSON object of the reasoning-gym generator's config keywords, with --task rg:<name>:
    '{"min_digits": 1, "max_digits": 2}' ('' = the generator's defaults). A completion scores
    1 when the generator gives its answer full credit, else 0; add "partial_credit": true for
    the generator's own scores, partial credit included (which pays a policy for hedging)."""
    dataset: str = ""
    """A Hugging Face dataset as the task, read offline with the `datasets` library (pip install
    'echo2p2p[data]'): a local .parquet, .jsonl/.json, .csv or .arrow file, a folder of them or
    one written by `save_to_disk`, or a dataset name ("openai/gsm8k") already in the local
    Hugging Face cache (never downloaded). Scored by math-verify ('' = --task)."""
    dataset_config: str = ""
    """The dataset's configuration, for datasets that have several ("main" of openai/gsm8k)."""
    dataset_split: str = "train"
    """Split of --dataset to train on (a single file is the split "train")."""
    dataset_eval_split: str = ""
    """Split of --dataset held out for evaluation ("test"); '' = hold out --eval-problems rows of
    --dataset-split (seeded; at most half of it), never trained on."""
    dataset_question_field: str = "question"
    """Column of --dataset holding the question; the prompt is the question and a line asking
    for the answer in \\boxed{}."""
    dataset_answer_field: str = "answer"
    """Column of --dataset holding the answer, or a worked solution that ends in it."""
    answer_format: str = "auto"
    """How the gold answer is taken from --dataset-answer-field: gsm8k (the text after the last
    "####"), math (the content of the last \\boxed{...}, as in MATH solutions), plain (the whole
    field) or auto (gsm8k if it holds "####", else math if it holds \\boxed{, else plain).
    Rows without an answer in that format are skipped and counted in the log."""
    env: str = ""
    """A multi-turn environment to train on instead of a task: the name of an installed
    entry point in the group "echo2p2p.environments" ("takeaway" is built in). Peers play its
    episodes and need the same package and version; the hub replays every episode to check
    it. Its seeds are the prompts: held-out seeds 0 .. --eval-problems - 1."""
    prompt_format: str = "auto"
    """How prompt text becomes token ids: chat (the tokenizer's chat template renders it as the
    user message, then the assistant's turn is opened; start-up fails if it has no template),
    plain (the text as is, no special tokens) or auto (chat when the tokenizer has a template).
    The hub leases the ids: peers, learner, evaluation and spot-checks all see the same ones."""
    system_prompt: str = ""
    """System message rendered before every prompt by the chat template ('' = none)."""
    chat_template_args: str = ""
    """JSON object of variables for the chat template, as the model documents them, e.g.
    '{"enable_thinking": false}' turns Qwen3's thinking off ('' = none)."""
    eval_every: int = 10
    """Held-out greedy accuracy every this many steps (0 = never)."""
    eval_problems: int = 256
    """Held-out problems per evaluation."""

    def __post_init__(self) -> None:
        if self.eval_problems < 1:
            raise ConfigError("eval_problems", f"must be >= 1, got {self.eval_problems}")
        if self.eval_every < 0:
            raise ConfigError("eval_every", f"must be >= 0, got {self.eval_every}")
        # imported here: the tasks package imports math-verify (sympy, ~0.5 s), which `--help`
        # must not wait for
        from echo2p2p.tasks.answers import ANSWER_FORMATS

        if self.answer_format not in ANSWER_FORMATS:
            raise ConfigError("answer_format", f"one of {', '.join(ANSWER_FORMATS)}, got "
                                               f"{self.answer_format!r}")
        if self.env and (self.task != "addition" or self.dataset):
            raise ConfigError("env", f"--env {self.env!r} and --{'dataset' if self.dataset else 'task'}"
                                     f" both name what to train on: set one of them")
        self._check_dataset()
        self.generator_args  # noqa: B018 - validates task_args
        self.prompts  # noqa: B018 - validates prompt_format and chat_template_args

    def _check_dataset(self) -> None:
        """The dataset fields: the names the task needs, and only with a dataset."""
        if not self.dataset:
            for name in ("dataset_config", "dataset_eval_split"):
                if getattr(self, name):
                    raise ConfigError(name, "only applies with --dataset")
            return
        if self.task != "addition":
            raise ConfigError("dataset", f"--task {self.task!r} and --dataset {self.dataset!r} "
                                         f"both name the task: set one of them")
        for name in ("dataset_split", "dataset_question_field", "dataset_answer_field"):
            if not getattr(self, name):
                raise ConfigError(name, "must name a split or column of --dataset, got ''")
        if self.dataset_eval_split == self.dataset_split:
            raise ConfigError("dataset_eval_split", f"is --dataset-split {self.dataset_split!r} "
                              f"too: name another split, or '' to hold out rows of it")

    @property
    def generator_args(self) -> dict:
        """--task-args as keywords (only with --task rg:<name>); ConfigError("task_args")."""
        if not self.task_args:
            return {}
        if not self.task.startswith("rg:"):
            raise ConfigError("task_args", "only applies with --task rg:<name>")
        return _json_object("task_args", self.task_args, '{"min_digits": 1, "max_digits": 2}')

    @property
    def prompts(self) -> PromptFormat:
        """How prompts are rendered (`echo2p2p.policy.prompts`); check it against the
        tokenizer at start-up."""
        args = {}
        if self.chat_template_args:
            args = _json_object("chat_template_args", self.chat_template_args,
                                '{"enable_thinking": false}')
        if self.prompt_format not in PROMPT_FORMATS:
            raise ConfigError("prompt_format", f"one of {', '.join(PROMPT_FORMATS)}, got "
                                               f"{self.prompt_format!r}")
        return PromptFormat(self.prompt_format, self.system_prompt, args)


@dataclass(frozen=True)
class ScoringConfig:
    """How completions are scored: reward functions, their workers and deadlines."""

    reward: str = ""
    """Reward functions to score with instead of the task's own, comma-separated: built-in
    names (exact_match, math_verify, code_tests: the completion's program run against the
    row's tests in a sandboxed subprocess) or module:function of your own, each
    f(prompt, completion, row) -> float, sync or async. They run on the hub only, in the
    scoring workers under --score-timeout-s (peers never need your code). '' = the task's."""
    reward_weights: str = ""
    """Weights of the --reward functions, comma-separated, one each ('' = all 1)."""
    score_timeout_s: float = 5.0
    """Deadline for scoring one completion with the task's verifier, which runs in worker
    processes off the event loop; a completion past it scores 0, its worker is killed and
    restarted, and the event is counted (math-verify can run for ever on some answers).
    Lower: a hostile completion stalls scoring for less time; too low scores slow but honest
    answers 0."""
    score_workers: int = 1
    """Worker processes scoring rollouts (each a full Python with the task's verifier). More:
    a verifier that overruns stalls only one of them, and scoring uses more cores."""
    score_sample_budget_s: float = 1.0
    """Scoring seconds one peer's samples may take each, on average over about the last
    minute, while other peers score too: past it its rollouts are refused unscored
    ("scoring_budget") until what it used has decayed below this (about a minute and a half
    after a group that burnt the deadline). The scorer serves the peer that used least first
    anyway. Lower: samples that burn the deadline are cut off sooner; too low refuses honest
    peers whose verifier is slow (code: ~0.1-0.3 s a sample; math-verify: ms) (0 = none)."""
    code_answer_hold_s: float = 0.0
    """With a reward that runs the completion's program (code_tests): the hub's answer to a
    rollout leaves no earlier than this many seconds after the rollout arrived, so its timing
    tells nothing of how long the programs ran (what is admitted is trained on at once; only
    the answer waits). 0 = group_size x score_timeout_s, the longest one group's scoring may
    take; an answer judged later than that (a scorer backed up) leaves when judged."""
    unisolated_code: bool = False
    """With a reward that runs the completion's program (code_tests), start even where the
    sandbox cannot give programs namespaces of their own (no user namespaces for a user that is
    not root): they then reach the network, write what this user can write and leave shared
    memory behind. Off: such a machine is refused at start, saying why."""

    def __post_init__(self) -> None:
        if self.score_workers < 1:
            raise ConfigError("score_workers", f"must be >= 1, got {self.score_workers}")
        if not 0 < self.score_timeout_s < float("inf"):  # a deadline that never comes is none
            raise ConfigError("score_timeout_s", f"must be > 0 and finite, got {self.score_timeout_s}")
        for name in ("score_sample_budget_s", "code_answer_hold_s"):  # 0: see each
            if not 0 <= getattr(self, name) < float("inf"):
                raise ConfigError(name, f"must be >= 0 and finite, got {getattr(self, name)}")
        if self.reward_weights and not self.reward:
            raise ConfigError("reward_weights", "weights need --reward functions to weigh")


@dataclass(frozen=True)
class StalenessConfig:
    """Staleness and leases: how old a rollout may be, who generates, how long a lease lasts."""

    max_lag: int = 2
    """S, the staleness bound: step t trains on version x only if t - x <= S. Higher S: more
    overlap of generation and training, more off-policy noise. 0 = synchronous."""
    publish_every: int = 0
    """kappa, steps between published versions; 0 means max(1, S - 1). Must be <= S + 1."""
    lease_timeout_s: float = 60.0
    """A lease not answered within this many seconds is re-issued to another peer."""
    new_peer_leases: int = 2
    """Open leases a peer (and an address) that has delivered nothing may hold; each admitted
    group raises its cap by one, each lease it lets expire lowers it by two (echo2p2p.lease_quota).
    Peers that have not delivered more groups than they let expire share prompts_per_step
    leases on top of the budget, so hoarders never starve the learner, and an expiry costs them
    trust. Higher: new peers ramp up faster, hoarders hold more."""
    activation: str = "cost"
    """Which peers generate: cost (the cheapest set whose measured throughput meets the capacity
    rule plus --activation-margin; free peers always work, the others wait on standby) or all."""
    activation_margin: float = 0.1
    """Safety margin of cost-aware activation: provision this much more than the rule requires."""

    def __post_init__(self) -> None:
        if self.publish_every < 0:
            raise ConfigError("publish_every", f"must be >= 0, got {self.publish_every}")
        check_schedule(self.max_lag, self.kappa)
        if not self.lease_timeout_s > 0:
            raise ConfigError("lease_timeout_s", f"must be > 0, got {self.lease_timeout_s}")
        if self.new_peer_leases < 1:
            raise ConfigError("new_peer_leases", f"must be >= 1, got {self.new_peer_leases}")
        if self.activation not in POLICIES:
            raise ConfigError("activation", f"one of {', '.join(POLICIES)}, got {self.activation!r}")
        if not 0 <= self.activation_margin <= 10:
            raise ConfigError("activation_margin", f"must be in [0, 10], got {self.activation_margin}")

    @property
    def kappa(self) -> int:
        """The publication period actually used."""
        return self.publish_every or default_publish_every(self.max_lag)


@dataclass(frozen=True)
class OverlayConfig:
    """Versions on the wire: their format, how they reach peers, what the hub keeps."""

    relay: str = "gossip"
    """How versions reach peers: gossip (peers tell their neighbours what they hold and fetch
    from each other; one announcement per peer from the hub, which uploads each version about
    once), pipelined (the hub as tracker: it deals every chunk to a relaying peer and answers
    lookups; it too uploads about once, but a NAT'd peer serves nobody), striped-chain (the
    ECHO-2 paper's: each chunk's owner fetches it from the hub, every other peer fetches it
    from its predecessor in a ring; as fast as the slowest uplink) or star (the hub uploads
    every version to every peer). docs/benchmarks.md has them raced."""
    weights_dtype: str = "bfloat16"
    """dtype of published versions: bfloat16 (half the bytes) or float32."""
    chunk_bytes: int = 0
    """Raw bytes per snapshot chunk; each chunk is compressed, hashed and relayed on its own.
    0 = about a thousandth of the version, 64 KiB to 8 MiB (see snapshot.auto_chunk_bytes)."""
    zstd_level: int = 3
    """zstd level for snapshot chunks."""
    tcp_congestion: str = "cubic"
    """TCP congestion control of the sockets the hub serves chunks on ('' = the machine's
    default; see echo2p2p.runtime.tcp for why cubic)."""
    anchor_every: int = 10
    """Every this many published versions go out in full; the others as lossless deltas to the
    peers holding the previous version (1 = never send deltas)."""
    keep_versions: int = 3
    """Published versions the hub keeps to serve (late fetches, deltas' bases)."""
    catch_up_versions: int = 16
    """A peer up to this many versions behind (back from a disconnect, or from cold standby)
    catches up with one delta from the version it holds instead of the newest in full; the hub
    keeps this many older streams for it (mapped files: 2P bytes of disk each). 0 = always in full.
    Lowered for a big model by catch_up_disk_bytes."""
    catch_up_disk_bytes: int = 2 ** 30
    """Disk for the streams kept for catch-up: catch_up_versions is lowered so that they fit
    (2P bytes each; never below max_lag + 2), a laggard further back takes the newest version
    in full (SmolLM2-135M at S = 2: 4 versions). 0 = exactly catch_up_versions."""
    catch_up_builds: int = 1
    """Catch-up deltas the hub encodes at once (off the event loop; each is shared by every peer
    on the same base); a peer that would need another meanwhile gets the newest in full."""
    upload_limit_mbps: float = 0.0
    """Cap on the hub's chunk upload, in Mbit/s (0 = no cap)."""
    standby: str = "warm"
    """What standby peers receive: warm (every version, so they can start at once when
    activated) or cold (nothing until activated, then the newest version: one delta from the
    version the peer holds if within catch_up_versions, else, or if a newer version comes out
    while that delta is encoded, in full)."""

    def __post_init__(self) -> None:
        if self.relay not in STRATEGIES:
            raise ConfigError("relay", f"one of {', '.join(STRATEGIES)}, got {self.relay!r}")
        if self.weights_dtype not in ("bfloat16", "float32"):
            raise ConfigError("weights_dtype", f"bfloat16 or float32, got {self.weights_dtype!r}")
        if self.chunk_bytes < 0:
            raise ConfigError("chunk_bytes", f"must be >= 0 (0 = automatic), got {self.chunk_bytes}")
        check_congestion(self.tcp_congestion)
        if not 0 <= self.catch_up_versions <= 1024:
            raise ConfigError("catch_up_versions", f"must be in [0, 1024], got {self.catch_up_versions}")
        for name, least in (("anchor_every", 1), ("keep_versions", 2), ("catch_up_builds", 1),
                            ("upload_limit_mbps", 0), ("catch_up_disk_bytes", 0)):
            if not getattr(self, name) >= least:  # NaN too
                raise ConfigError(name, f"must be >= {least}, got {getattr(self, name)}")
        if self.standby not in ("warm", "cold"):
            raise ConfigError("standby", f"warm or cold, got {self.standby!r}")


@dataclass(frozen=True)
class LearnerConfig:
    """The learner: where and how a step is computed."""

    device: str = "cpu"
    """Where the learner runs: cpu, cuda, cuda:1."""
    torch_threads: int = 0
    """Threads for torch on the hub (0 = torch's default)."""
    learner_micro_tokens: int = 16384
    """Padded tokens (samples x the longest) per learner micro-batch; a longer sample goes
    alone. The step's activation memory follows this budget, not the batch's longest completion:
    lower it if a step runs out of memory, raise it for speed."""
    learner_micro_bytes: int = 2 * 2 ** 30
    """Memory for one micro-batch's activations and fp32 logits: learner_micro_tokens is lowered
    so that they fit, counting the model's hidden size, layers and vocabulary
    (`echo2p2p.learner_size.micro_batch_bytes_per_token`; SmolLM2-135M: about 800 tokens).
    0 = exactly learner_micro_tokens."""
    learner_precision: str = "fp32"
    """fp32, or bf16: the learner computes in bf16 over fp32 master weights (gradients reduced
    in fp32 when sharded). Less memory and faster on GPUs, logprobs rounded (the ratio absorbs it)."""
    learner_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them:
    about a third more step time for activations of one layer instead of all."""
    learner_timeout_s: float = 600.0
    """A sharded learner (launched with torchrun) waits this long for the rendezvous and for any
    one collective of another rank; past it the run stops and says how to resume."""

    def __post_init__(self) -> None:
        if self.learner_micro_tokens < 1:
            raise ConfigError("learner_micro_tokens", f"must be >= 1, got {self.learner_micro_tokens}")
        if self.learner_micro_bytes < 0:
            raise ConfigError("learner_micro_bytes", f"must be >= 0 (0 = no budget), got {self.learner_micro_bytes}")
        if self.learner_precision not in ("fp32", "bf16"):
            raise ConfigError("learner_precision", f"fp32 or bf16, got {self.learner_precision!r}")
        if not 0 < self.learner_timeout_s < float("inf"):
            raise ConfigError("learner_timeout_s", f"must be > 0 and finite, got {self.learner_timeout_s}")
        check_device(self.device)  # a CUDA device on a CPU-only torch fails here, not mid-load


@dataclass(frozen=True)
class LimitsConfig:
    """Limits: what one peer, address or join token may cost the hub."""

    max_frame_bytes: int = 4 << 20
    """Largest websocket frame accepted from a peer."""
    max_peers_per_address: int = 256
    """Joined connections accepted from one IP address; more are refused (close code 4005).
    Bounds what one attacker's many connections can cost; raise it for a lab behind one NAT."""
    joins_per_min: float = 120.0
    """Joins a minute, sustained, from one IP address (an IPv6 /64) and with one join token;
    more are refused (close code 4005) before the hub does any work for them (0 = no limit).
    Bounds what reconnect churn costs the hub; raise it for a lab behind one NAT."""
    join_burst: int = 64
    """Joins at once from one address or with one join token before `joins_per_min` holds: an
    honest peer's reconnect, or a lab's peers back from a hub restart, get straight in."""
    joins_per_min_per_key: float = 6.0
    """Joins a minute, sustained, with one peer key (one peer process; 0 = no limit)."""
    join_burst_per_key: int = 4
    """Joins at once with one peer key before `joins_per_min_per_key` holds."""
    joins_per_min_total: float = 300.0
    """Joins a minute, sustained, for the whole hub, shared fairly among the networks joining
    (an IPv4 /24, an IPv6 /48: each network's share is this over the networks that joined in
    the last minute), so churn from many addresses costs the hub no more than this; past it,
    connections are answered HTTP 429 before any websocket work (0 = no limit). Lower: less
    hub time on churn, a big fleet's restart takes longer to rejoin."""
    join_burst_total: int = 256
    """Joins at once for the whole hub before `joins_per_min_total` holds (a fleet back from a
    hub restart); each network may take `join_burst` of them at once."""
    http_requests_per_min: float = 600.0
    """Requests a minute, sustained, from one IP address (an IPv6 /64) to /status, /metrics and
    the dashboard, on either port (0 = no limit). Past it a request waits its turn, up to 2 s,
    then is answered 429 with Retry-After; each answer is built at most once a second anyway.
    Model files and chunks have budgets of their own, sized for many peers behind one NAT."""
    http_burst: int = 120
    """Requests at once from one address to those routes before `http_requests_per_min` holds
    (a page load is 6)."""

    def __post_init__(self) -> None:
        for name, least in (("max_frame_bytes", 1), ("joins_per_min", 0), ("join_burst", 1),
                            ("joins_per_min_per_key", 0), ("join_burst_per_key", 1),
                            ("joins_per_min_total", 0), ("join_burst_total", 1),
                            ("http_requests_per_min", 0), ("http_burst", 1)):
            if not getattr(self, name) >= least:  # NaN too
                raise ConfigError(name, f"must be >= {least}, got {getattr(self, name)}")


@dataclass(frozen=True)
class TrustConfig:
    """Trust: how the hub spot-checks peers' logprobs."""

    spot_check_fraction: float = 0.05
    """Share of rollout groups whose behaviour logprobs the hub recomputes under the version the
    peer claims (0 = off, 1 = every group); a mismatch counts against the peer's trust. Costs
    one forward per checked group, an fp32 model copy (4 bytes a parameter) and the last S + 1
    published versions, kept on disk in <run_dir>/versions and memory-mapped: (S + 1) x
    parameters x 2 bytes in bf16 of files (~42 GB for a 7B model at S = 2), not of RAM."""
    spot_check_probation: int = 8
    """Spot-checks a peer must pass before its groups are checked less often than every one
    (times 1 + its trust events; any event starts it over); then a share due/passed of them,
    down to spot_check_fraction. A forger's first groups are all checked, so it is caught
    before they are trained on; an honest peer costs the hub a forward per group while on
    probation, then a share falling as about sqrt(due / 2n) near its n-th group. 0: the
    plain fraction for all; spot_check_fraction 0 turns checks off whatever this is."""
    spot_check_tokens: int = 0
    """Completion tokens compared per sample, drawn at random (0 = all). Fewer: a forward cut
    at the last drawn position, less evidence per check; the memory stays the same."""
    spot_check_tolerance: float = 0.2
    """A checked group fails when the mean |claimed - recomputed| logprob over its checked
    tokens exceeds this, in nats: about the |log-ratio| an undetected forgery adds. One bar for
    every engine and dtype (a peer's dtype is its claim), told to peers in the welcome. 0.2 ~
    log(1 + clip_eps); 6x the worst group of honest bf16 peers on SmolLM2-135M (0.033; bf16
    tokens reach 0.6), 4e4x fp32 ones; SmolLM2's forged groups start at 0.22
    (bench/logprob_drift.py, hub.learning.spotcheck). Lower: more forgeries caught, honest bf16
    peers at risk; raise it for MoE or FP8 peers (~0.5)."""

    def __post_init__(self) -> None:
        if not 0 <= self.spot_check_fraction <= 1:
            raise ConfigError("spot_check_fraction",
                              f"must be in [0, 1], got {self.spot_check_fraction}")
        for name in ("spot_check_probation", "spot_check_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if not self.spot_check_tolerance > 0:
            raise ConfigError("spot_check_tolerance", f"must be > 0, got {self.spot_check_tolerance}")


@dataclass(frozen=True)
class ViewConfig:
    """Watching the run: the dashboard and experiment trackers."""

    dashboard_host: str = "127.0.0.1"
    """Address the live dashboard listens on, with /metrics (Prometheus) and /status: a port
    of its own, with --tls-cert's TLS. It shows peers' addresses: on any address but loopback
    it needs --dashboard-token."""
    dashboard_port: int = 0
    """TCP port of the dashboard (0 picks a free one; the hub's log prints the URL; -1 = no
    dashboard)."""
    dashboard_token: str = ""
    """Read-only access token of the dashboard, /metrics and /status on its port: sent as
    `Authorization: Bearer TOKEN` or once as ?token=TOKEN in the page's URL ('' = none, only
    on loopback). /status on the peers' port answers all of it only with this token (or, with
    none set, on a loopback --host), else only the run's public part: no peer is named."""
    report_to: str = ""
    """Experiment trackers that also get every run log record, comma-separated: wandb,
    tensorboard (pip install 'echo2p2p[wandb]' or '[tensorboard]'; WANDB_MODE=offline works
    offline; TensorBoard's event files go to <run_dir>/tensorboard). '' = the run log only."""

    def __post_init__(self) -> None:
        if not -1 <= self.dashboard_port < 65536:
            raise ConfigError("dashboard_port", f"a TCP port, 0 (a free one) or -1 (none), got "
                                                f"{self.dashboard_port}")
        if self.dashboard_port >= 0 and not self.dashboard_token and not is_loopback(self.dashboard_host):
            raise ConfigError("dashboard_token", f"the dashboard shows peers' addresses: set a "
                              f"token to serve it on {self.dashboard_host}, or bind it to 127.0.0.1")
        unknown = set(names(self.report_to)) - set(TRACKERS)
        if unknown:
            raise ConfigError("report_to", f"{', '.join(sorted(unknown))}: the trackers are "
                                           f"{', '.join(TRACKERS)}")


def names(text: str) -> list[str]:
    """The names of a comma-separated field ("wandb, tensorboard"), blanks dropped."""
    return [n.strip() for n in text.split(",") if n.strip()]


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

"""Rewrite reads of the flat `HubConfig` (issue 29) to its sections: `cfg.lr` -> `cfg.grpo.lr`.

    .venv/bin/python rewrite_fields.py [--dry-run] [PATH ...]   (from the repository root;
                                                                 default: hub peer echo2p2p tests bench)

Re-runnable and idempotent: a read already in its section is left alone, so run it again on
code merged from a branch written against the flat config. What it rewrites:

- `<recv>.<field>` where <recv> ends in a name that holds a HubConfig (`cfg`, `self.cfg`,
  `hub.cfg`, `config`, `hub_cfg`, `CFG`, `HUB`, or is `HubConfig()`): `<recv>.<section>.<field>`,
  and `HubConfig.<field>` (the default, in code or docs): `<SectionConfig>.<field>`;
- `HubConfig(field=...)` -> `HubConfig.from_flat(field=...)` (`HubConfig()` stays);
- `replace(<recv>, field=...)` / `dataclasses.replace(<recv>, ...)` -> `<recv>.replace(...)`;
- `Part(<recv>` -> `Part(<recv>.<section>` for the parts given one section (PARTS).

It never guesses across config classes: `PeerConfig` and `PlanConfig` share field names with
the hub (`device`, `max_lag`, `model`...), so in peer/, hub/plan.py and files that name either
class, the shared names are left as they are and listed for a hand check ("check:" lines).
Reads through `getattr`, or on other names, are for a person too: grep the FIELDS after it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

SECTIONS = {
    "run": "model seed max_steps run_dir checkpoint_every",
    "network": "host port tls_cert tls_key tokens heartbeat_s peer_timeout_s",
    "tasks": "task dataset dataset_config dataset_split dataset_eval_split dataset_question_field "
            "dataset_answer_field answer_format env prompt_format system_prompt "
            "chat_template_args eval_every eval_problems prompts",
    "scoring": "reward reward_weights score_timeout_s score_workers score_sample_budget_s "
               "code_answer_hold_s",
    "grpo": "group_size prompts_per_step lr clip_eps kl_coef temperature top_p max_new_tokens",
    "staleness": "max_lag publish_every lease_timeout_s new_peer_leases activation "
                 "activation_margin kappa",
    "overlay": "relay weights_dtype chunk_bytes zstd_level tcp_congestion anchor_every "
               "keep_versions catch_up_versions catch_up_builds upload_limit_mbps standby",
    "learner": "device torch_threads learner_micro_tokens learner_precision "
               "learner_checkpointing learner_timeout_s",
    "limits": "max_frame_bytes max_peers_per_address joins_per_min join_burst "
              "joins_per_min_per_key join_burst_per_key",
    "trust": "spot_check_fraction spot_check_probation spot_check_tokens spot_check_tolerance",
    "view": "dashboard_host dashboard_port dashboard_token report_to",
}
FIELDS = {f: s for s, names in SECTIONS.items() for f in names.split()}
# Parts constructed with one section instead of the whole config: `Door(cfg, ...)` ->
# `Door(cfg.limits, ...)`. Inside them the section has its own name (`self.limits.join_burst`),
# which the field rewrite does not touch.
PARTS = {"Door": "limits", "Publisher": "overlay", "VersionTracker": "overlay",
         "open_trackers": "view", "open_dataset_task": "tasks"}
# Names that hold a HubConfig (the last name of the receiver).
RECEIVERS = r"(?:cfg|_cfg|config|hub_cfg|hub_config|CFG|HUB)"
# Names that hold another config class; a receiver path through them is left alone.
OTHER_PATHS = re.compile(r"(?:peer|client|plan|model|tokenizer|hf|args)\w*\.$")
SHARED = {  # field names of the hub's that the peer's or the plan's config has too
    "PeerConfig": {"device", "torch_threads", "heartbeat_s", "max_frame_bytes",
                   "upload_limit_mbps", "tcp_congestion", "keep_versions", "score_timeout_s"},
    "PlanConfig": {"model", "max_lag", "publish_every", "relay", "kappa"},
}
# Names that moved from hub/config.py to hub/config_sections.py, as the hub's modules import them.
MOVED = {"from .config import is_loopback\n": "from .config_sections import is_loopback\n"}
SKIP_FILES = ("rewrite_fields.py", "hub/config.py", "hub/config_sections.py", "echo2p2p/config.py")


# Idempotent because no section is named as a field: `cfg.tasks.task` has no `cfg.<field>`.
assert not set(SECTIONS) & set(FIELDS)
READ = re.compile(
    r"(?P<path>(?:[A-Za-z_]\w*(?:\[[^\]\n]*\])?\.)*)(?P<recv>(?<![\w])" + RECEIVERS + r")"
    r"\.(?P<field>" + "|".join(sorted(FIELDS, key=len, reverse=True)) + r")\b(?!\s*=[^=])")
CONSTRUCT = re.compile(r"\bHubConfig\((?!\))")
DEFAULTS = re.compile(r"\bHubConfig(?P<call>\(\))?\.(?P<field>" + "|".join(FIELDS) + r")\b")
CLASSES = {"run": "RunConfig", "network": "NetworkConfig", "tasks": "TasksConfig",
           "scoring": "ScoringConfig", "grpo": "GrpoConfig", "staleness": "StalenessConfig",
           "overlay": "OverlayConfig", "learner": "LearnerConfig", "limits": "LimitsConfig",
           "trust": "TrustConfig", "view": "ViewConfig"}
REPLACE = re.compile(r"(?<![\w.])(?:dataclasses\.)?replace\(\s*(?P<recv>(?:[A-Za-z_]\w*\.)*"
                     + RECEIVERS + r")\s*,\s*")


def ambiguous(path: Path, text: str) -> set[str]:
    """Field names whose reads in this file may be on another config class."""
    names: set[str] = set()
    if "peer" in path.parts[:1] or path.name == "plan.py" and "hub" in path.parts:
        names |= SHARED["PeerConfig"] | SHARED["PlanConfig"]
    for cls, shared in SHARED.items():
        if cls in text:
            names |= shared
    return names


def rewrite(path: Path, text: str) -> tuple[str, list[str]]:
    """The file's text rewritten, and the lines a person should check."""
    unsure = ambiguous(path, text)
    checks: list[str] = []

    def read(m: re.Match) -> str:
        field, recv, prefix = m["field"], m["recv"], m["path"]
        section = FIELDS[field]
        if OTHER_PATHS.search(prefix):
            return m[0]
        if field in unsure:
            line = text.count("\n", 0, m.start()) + 1
            checks.append(f"check: {path}:{line}: {m[0]} (another config has {field})")
            return m[0]
        return f"{prefix}{recv}.{section}.{field}"

    def default(m: re.Match) -> str:  # `HubConfig().lr`; `HubConfig.lr`, a class's default
        section = FIELDS[m["field"]]
        return (f"HubConfig().{section}." if m["call"] else f"{CLASSES[section]}.") + m["field"]

    text = READ.sub(read, text)
    text = DEFAULTS.sub(default, text)
    text = CONSTRUCT.sub("HubConfig.from_flat(", text)

    def replaced(m: re.Match) -> str:
        if unsure and not re.search(r"\b(?:hub_cfg|hub_config|HUB)$", m["recv"]):
            line = text.count("\n", 0, m.start()) + 1
            checks.append(f"check: {path}:{line}: {m[0]}... beside another config class")
            return m[0]
        return f"{m['recv']}.replace("

    text = REPLACE.sub(replaced, text)
    for old, new in MOVED.items():
        text = text.replace(old, new)
    for part, section in PARTS.items():  # `Door(cfg, ...)`, `to_thread(open_trackers, cfg, ...)`
        text = re.sub(r"\b" + part + r"(?P<open>\(\s*|,\s*)(?P<recv>(?:[A-Za-z_]\w*\.)*" + RECEIVERS
                      + r")(?=\s*[,)])", lambda m, s=section: f"{m[0]}.{s}", text)
    return text, checks


def main(argv: list[str]) -> int:
    dry = "--dry-run" in argv
    roots = [Path(a) for a in argv if a != "--dry-run"] or [
        Path(p) for p in ("hub", "peer", "echo2p2p", "tests", "bench")]
    files = [f for r in roots for f in ([r] if r.is_file() else sorted(r.rglob("*.py")))]
    changed = 0
    for path in files:
        if str(path).endswith(SKIP_FILES) or ".venv" in path.parts:
            continue
        text = path.read_text(encoding="utf-8")
        new, checks = rewrite(path, text)
        for c in checks:
            print(c)
        if new != text:
            changed += 1
            print(f"rewrote {path}")
            if not dry:
                path.write_text(new, encoding="utf-8")
    print(f"{changed} files {'would change' if dry else 'changed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The printed resume command resumes the same thing: the demo's own flags, which no config
field saves, are carried; the run's fields come back from its config.json (the system tests
tests/hub/cli/test_demo_signals.py and test_stop_resume.py run the printed commands)."""

from __future__ import annotations

import sys
from pathlib import Path

from echo2p2p.hub.config import HubConfig
from echo2p2p.hub.run import demo_flags, resume_hint


def test_a_demos_resume_command_carries_the_flags_it_was_started_with():
    cfg, run_dir = HubConfig(), Path("runs/abc")
    plain = resume_hint(cfg, run_dir, "demo", flags=demo_flags(2, "transformers", sys.executable))
    assert plain == "echo2-hub demo --resume runs/abc --peers 2"
    vllm = demo_flags(3, "vllm", "/opt/vllm/bin/python")
    assert vllm == " --peers 3 --engine vllm --peer-python /opt/vllm/bin/python"
    secret = resume_hint(cfg.replace(dashboard_token="s"), run_dir, "serve")
    assert secret == "echo2-hub serve --resume runs/abc --dashboard-token TOKEN"
    assert resume_hint(cfg, run_dir, "demo", scripted=True) == \
        "Run(...).demo(resume='runs/abc') in your script"

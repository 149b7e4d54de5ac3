"""The code-reward sandbox under attack (issue 28, items 2-4; issue 42, item 5): a hub training on
a code task (its reward runs the completion's program against the row's tests), an honest peer,
and raw peers submitting chosen token ids.

- R3-2: a program that reads the hub's key and sleeps on one of its bits, one rollout per bit,
  to read the bit back from the ack's timing. The key is not there to read, and every answer
  leaves at the hold after arrival, whatever the program did.
- R3-3: a completion that reads the harness's token from its program file, prints the pass
  line and calls os._exit(0), which the old harness scored 1.0 on any problem.
- R3-4: four connections whose samples sleep to the sandbox's limit, to saturate the scorer.
- 42-5: programs that make and fill System V shared-memory segments and open a POSIX message
  queue, which outlived the sample, the run and the peer in the host's IPC namespace; their
  peer runs in a process of its own (tests/hostile/peer_attacks.py, kind "rollouts"), as its
  cost is a rate.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path

import pytest

from echo2p2p.messages import pack_ids, pack_logprobs
from echo2p2p.scoring import code
from echo2p2p.scoring.sandbox_child import NOBODY

from tests.conftest import until
from tests.echo2p2p.scoring import host_ipc

from .attackers import RawPeer, raw_peer
from .conftest import yes
from .harness import (HONEST, Rates, attacker_process, cell_rate, family, hub_alive,
                      hub_and_honest_peer, mark, peer_id, small_cfg, steps_per_min,
                      still_training)

PROGRAM = "def answer():\n    return {completion}\n"  # examples/code.jsonl's template
SANDBOX_S = 1.0  # each row's sandbox limit (timeout_s)
SCORE_DEADLINE_S = 1.5  # the scorer's, per completion: room for the sandbox's limit
GROUP = 4  # small_cfg's group_size: the answer hold is GROUP x SCORE_DEADLINE_S
# The forgery, shortened to 90 characters: the token is the first quoted string of the
# old harness's main.py; print it with every test's index, then leave before any test runs.
FORGERY = ("__import__('os')._exit(print('\\n'+open('main.py').read().split(\"'\")[1],0,1,2,"
           "flush=1)or 0)")
BIT_SLEEP_S = 0.3  # per sample, when the bit read is 1


def code_task(tmp_path: Path) -> str:
    """40 rows as examples/code.jsonl writes them (a sum to return), with a 1 s sandbox."""
    rows = []
    for i in range(40):
        a, b = 10 + 7 * i, 20 + 3 * i
        total = a + b
        rows.append({"id": f"code-{i}", "prompt": f"{a}+{b}=", "program": PROGRAM,
                     "tests": [f"assert answer() % 10 == {total % 10}",
                               f"assert answer() % 100 == {total % 100}",
                               f"assert answer() == {total}"],
                     "answer": str(total), "timeout_s": SANDBOX_S})
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def code_cfg(tmp_path: Path, **overrides):
    return small_cfg(tmp_path, task=code_task(tmp_path), reward="code_tests", max_new_tokens=160,
                     spot_check_fraction=0.0, score_timeout_s=SCORE_DEADLINE_S, **overrides)


def token_ids(tok, text: str) -> list[int]:
    """Token ids that decode to `text`, EOS kept (as engines keep it)."""
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def sample(tok, text: str, reward: float = 0.0) -> dict:
    """A sample whose token ids decode to `text` (EOS kept, as engines keep it)."""
    ids = token_ids(tok, text)
    return {"token_ids": pack_ids(ids), "text": text, "reward": reward,
            "logprobs": pack_logprobs([-1.0] * len(ids)), "finish_reason": "stop"}


def newest_version(peer: RawPeer) -> int:
    return max(f["manifest"]["version"] for f in peer.frames if f["t"] == "version")


async def submit(peer: RawPeer, tok, texts: list[str], reward: float = 0.0
                 ) -> tuple[dict, float]:
    """Lease one prompt, submit `texts` as its group; the hub's answer and its delay (from the
    rollout sent to its answer received)."""
    since = len(peer.frames)
    await peer.send("lease_request", n=1)
    lease = await peer.wait_frame(lambda f: f["t"] == "lease", since=since)
    samples = [sample(tok, t, reward) for t in texts][:lease["group_size"]]
    sent = time.monotonic()
    await peer.send("rollout", lease_id=lease["lease_id"], version=newest_version(peer),
                    samples=samples)
    answer = await peer.wait_frame(
        lambda f: f["t"] in ("ack", "reject") and f["lease_id"] == lease["lease_id"])
    return answer, time.monotonic() - sent


@pytest.mark.timeout(400)
async def test_code_cannot_read_the_hubs_key_and_acks_say_nothing_of_run_time(tmp_path, row):
    """A program finds no hub file to read (the key is 0600 too), and every answer to a code
    rollout leaves no earlier than the hold after arrival, whatever its programs did."""
    r = row("R3-2. code reward reads <run_dir>/hub_key, sleeps on bit b of byte 0: 8 rollouts")
    cfg = code_cfg(tmp_path)
    hold_s = GROUP * SCORE_DEADLINE_S  # the default hold (ScoringConfig.code_answer_hold_s = 0)
    async with hub_and_honest_peer(cfg) as (run, honest), \
            raw_peer(run.url, keep_alive=True) as spy:
        key_path = Path(run.runlog.run_dir) / "hub_key"
        byte0 = key_path.read_bytes()[0]
        assert await spy.hello(name="spy", engine="transformers") is not None, spy.reaction()
        since = mark(run, honest)
        delays = []
        for bit in range(8):
            leak = (f"__import__('time').sleep({BIT_SLEEP_S}*(open({str(key_path)!r},'rb')"
                    f".read()[0]>>{bit}&1))")
            answer, delay_s = await submit(spy, run.tokenizer, [leak] * GROUP)
            delays.append((bit, answer["t"], delay_s))
        r.honest_training = await still_training(run, honest, since)
        r.hub_alive = yes(alive := await hub_alive(run))
        # What the reward itself lets a program read, the hub's own run directory included.
        probe = {"program": PROGRAM, "tests": "assert answer()"}
        reads = {what: await asyncio.to_thread(code.code_tests, "", expr, probe) for what, expr in {
            "hub_key": f"len(open({str(key_path)!r},'rb').read())",
            "run dir": f"len(__import__('os').listdir({str(run.runlog.run_dir)!r}))",
            "/ (control)": "len(__import__('os').listdir('/'))"}.items()}
    fastest = min(d for _, _, d in delays)
    guessed = sum(((d - fastest > GROUP * BIT_SLEEP_S / 2) == bool(byte0 >> bit & 1))
                  for bit, _, d in delays)
    early = [round(d, 2) for _, _, d in delays if d < hold_s]
    key_mode = stat.S_IMODE(os.stat(key_path).st_mode)
    r.reaction = (f"answers {', '.join(sorted({a for _, a, _ in delays}))} after "
                  f"{fastest:.2f}-{max(d for _, _, d in delays):.2f} s (hold {hold_s:g} s); "
                  f"readable by the program: "
                  f"{', '.join(w for w, ok in reads.items() if ok) or 'nothing'}; "
                  f"hub_key mode {key_mode:o}")
    r.note = (f"{guessed} of 8 bits guessed from answer times (chance: the key is not there "
              f"and every answer waits for the hold)")
    assert alive
    assert not early, f"answers left before the {hold_s:g} s hold: {early}"
    assert reads == {"hub_key": 0.0, "run dir": 0.0, "/ (control)": 1.0}, reads
    assert key_mode == 0o600


@pytest.mark.timeout(400)
async def test_a_forged_pass_scores_zero_and_costs_trust(tmp_path, row):
    """The harness-token forgery scores 0 (its program never answers the tests) and counts
    against the peer as forged_pass."""
    r = row("R3-3. code reward forged: completion reads the harness token, prints the pass "
            "line, os._exit(0)")
    cfg = code_cfg(tmp_path)
    async with hub_and_honest_peer(cfg) as (run, honest), \
            raw_peer(run.url, keep_alive=True) as forger:
        assert await forger.hello(name="forger", engine="transformers") is not None
        since = mark(run, honest)
        answers = [(await submit(forger, run.tokenizer, [FORGERY] * GROUP, reward=1.0))[0]
                   for _ in range(2)]
        r.honest_training = await still_training(run, honest, since)
        r.hub_alive = yes(alive := await hub_alive(run))
        events = run.hub.statistics().trust_events.get(forger.peer_id, {})
        forged = getattr(run.hub.statistics(), "forged_passes", None)  # None: a hub without it
        verdicts = ", ".join(f"{a['t']} {a.get('reason', '')}".strip() for a in answers)
        r.reaction = (f"rollouts {verdicts}; forged_passes {forged}; forger forged_pass "
                      f"x{events.get('forged_pass', 0)}, trust "
                      f"{run.hub.statistics().trust_scores.get(forger.peer_id, 1.0):.1f}")
        r.note = f"{len(FORGERY)}-character completion; each sample scored 0"
    assert alive
    assert events.get("forged_pass", 0) == 2, events
    assert forged == 2 * GROUP
    row0 = json.loads(Path(cfg.tasks.task).read_text().splitlines()[0])
    with pytest.raises(code.ForgedPass):  # what the scoring worker turns into 0, noted FORGED
        await asyncio.to_thread(code.code_tests, row0["prompt"], FORGERY, row0)


BURN = "__import__('time').sleep(60)"  # to the sandbox's limit, every sample
RATE_STEPS = 10  # steps per rate measured: at ~1 s a step, 3 would see only the first burst


async def burn(run, name: str, peers: dict[str, RawPeer]) -> None:
    """Take every lease offered and answer it with samples that sleep to the limit, without
    waiting for the hub's answers (`peers[name]` is this connection)."""
    async with raw_peer(run.url, keep_alive=True) as peer:
        peers[name] = peer
        assert await peer.hello(name=name, engine="transformers") is not None
        await peer.send("lease_request", n=4)
        done: set[str] = set()
        while True:
            lease = await peer.wait_frame(
                lambda f: f["t"] == "lease" and f["lease_id"] not in done, timeout_s=3600)
            done.add(lease["lease_id"])
            await peer.send("rollout", lease_id=lease["lease_id"], version=newest_version(peer),
                            samples=[sample(run.tokenizer, BURN)] * lease["group_size"])
            await peer.send("lease_request", n=1)


@pytest.mark.timeout(900)
async def test_four_connections_burning_the_sandbox_limit_do_not_starve_scoring(tmp_path, row):
    """Four connections whose samples all run to the sandbox's limit: the scorer serves the
    honest peer first, refuses them past their budget, and training goes on."""
    r = row("R3-4. scoring saturation: 4 connections, every sample sleeps to the sandbox limit")
    cfg = code_cfg(tmp_path)
    peers: dict[str, RawPeer] = {}
    async with hub_and_honest_peer(cfg) as (run, honest):
        without = await steps_per_min(run, RATE_STEPS)
        async with asyncio.TaskGroup() as tg:
            burners = [tg.create_task(burn(run, f"burner-{i}", peers)) for i in range(4)]
            try:
                r.steps_per_min = cell_rate(without, await steps_per_min(run, RATE_STEPS))
                since = mark(run, honest)
                r.honest_training = await still_training(run, honest, since)

                def burners_cut_off() -> bool:  # each, once a sample of its was scored
                    return sum(v.over_scoring_budget for v in run.hub.peer_views().values()
                               if v.name.startswith("burner")) == 4
                await until(run.hub, burners_cut_off, 180)
                refusals = getattr(run.hub.statistics(), "scoring_refused", None)
                views = run.hub.peer_views()
                honest_used = views[peer_id(run, HONEST)].scoring_used_s
                used = {view.name: view.scoring_used_s for view in views.values()}
                cut_off = {view.name: view.over_scoring_budget for view in views.values()}
            finally:
                for task in burners:
                    task.cancel()
        r.hub_alive = yes(alive := await hub_alive(run))
    refused = {name: [f.get("reason", "") for f in peer.frames if f["t"] == "reject"]
               for name, peer in peers.items()}
    budget_refusals = sum(reasons.count("scoring_budget") for reasons in refused.values())
    r.reaction = (f"scoring_budget refusals {refusals} ({budget_refusals} seen by "
                  f"the burners so far: answers are held), burners leased nothing more "
                  f"({sum(cut_off.values())} of 4 over budget); scoring s of the last minute: "
                  f"honest {honest_used:.1f}, burners "
                  f"{max(v for k, v in used.items() if k != HONEST):.1f} at most")
    r.note = (f"sandbox limit {SANDBOX_S:g} s, budget {cfg.scoring.score_sample_budget_s:g} s a sample, "
              f"1 worker")
    assert alive
    assert refusals > 0
    assert cut_off == {HONEST: False, **{f"burner-{i}": True for i in range(4)}}, cut_off


MIB = 2**20
# One 16 MiB segment made, attached and filled at each call of answer(), which the row's three
# tests call: 48 MiB a sample, as the 384 MiB per 8-sample rollout. 149 characters.
SHM = ("[setattr(l.shmat,'restype',c.c_void_p)or c.memset(l.shmat(l.shmget(0,1<<24,896),None,0),"
       "1,1<<24)for c in[__import__('ctypes')]for l in[c.CDLL(None)]]")
QUEUE = "/echo2-hostile"  # O_CREAT | O_RDWR, mode 0600
MQ = f"[c.CDLL(None).mq_open(b'{QUEUE}',66,384,None)for c in[__import__('ctypes')]]"


@pytest.mark.timeout(600)
async def test_shared_memory_and_message_queues_are_gone_with_the_sample(tmp_path, row):
    """Rollouts whose programs make and fill System V segments and open a POSIX message queue,
    one after the other for as long as a rate is measured, leave the host's shared memory, its
    System V objects and its queues as they were, and training goes on."""
    r = row("42-5. shared memory and message queues: 3 of 4 samples fill 3 x 16 MiB System V "
            "segments, 1 opens a POSIX queue; rollouts back to back")
    cfg = code_cfg(tmp_path)
    host_ipc.unlink_queue(QUEUE)
    before = {kind: set(host_ipc.sysv(kind)) for kind in host_ipc.KINDS}
    try:
        async with hub_and_honest_peer(cfg) as (run, honest):
            without = await steps_per_min(run, RATE_STEPS)
            shmem_before = host_ipc.shmem_bytes()
            since = mark(run, honest)
            samples = [[text, token_ids(run.tokenizer, text)] for text in [SHM] * 3 + [MQ]]
            # In a process of its own (tests/hostile/peer_attacks.py), which stops once its
            # last rollout is answered.
            async with attacker_process("rollouts", run.url, name="hoarder",
                                        samples=samples) as hoarder:
                # Under way: its first rollout answered, and the next (at least) to come.
                await hoarder.wait_report(lambda c: c.get("answers", 0) >= 1)
                identity = run.hub.peer_views()[peer_id(run, "hoarder")].identity
                with_ = await steps_per_min(run, RATE_STEPS)
            report = hoarder.report
            shmem_after = host_ipc.shmem_bytes()
            left = {kind: [i for i, (_, uid) in host_ipc.sysv(kind).items()
                           if i not in before[kind] and uid == NOBODY]
                    for kind in host_ipc.KINDS}
            queue_left = host_ipc.queue_exists(QUEUE)
            after = await steps_per_min(run, RATE_STEPS)
            r.steps_per_min = Rates(without, with_, after).cell()
            r.honest_training = await still_training(run, honest, since)
            r.hub_alive = yes(alive := await hub_alive(run))
            events = run.hub.statistics().trust_events.get(identity, {})
    finally:  # what a leaking sandbox left (the red check on the old one)
        for kind in host_ipc.KINDS:
            host_ipc.remove_sysv(kind, {i for i, (_, uid) in host_ipc.sysv(kind).items()
                                        if i not in before[kind] and uid == NOBODY})
        host_ipc.unlink_queue(QUEUE)
    answers = report.get("answers", 0)
    r.reaction = (f"rollouts {', '.join(sorted(family(report, 'answer')))}; trust events "
                  f"{dict(events) or 'none'}; host Shmem "
                  f"{shmem_before / MIB:.0f} -> {shmem_after / MIB:.0f} MiB, new System V "
                  f"objects in the host's namespace: "
                  f"{', '.join(f'{k} {len(v)}' for k, v in left.items())}; queue left: "
                  f"{'yes' if queue_left else 'no'}")
    made = answers * 3 * 3
    r.note = f"{answers} rollouts, {made} segments of 16 MiB made ({made * 16} MiB)"
    assert alive
    assert answers >= 2
    assert left == {"shm": [], "msg": [], "sem": []}, left
    assert not queue_left
    assert shmem_after - shmem_before < 48 * MIB, (shmem_before, shmem_after)  # one sample's

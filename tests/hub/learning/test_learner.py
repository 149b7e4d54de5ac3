"""The GRPO learner on a tiny real Qwen3: updates, steps, rows it can trust, export, evaluation."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import transformers

from echo2p2p.buffer import ScoredGroup
from echo2p2p.messages import Sample, pack_ids, pack_logprobs
from echo2p2p.rows import BAD_SAMPLE, BAD_TOKENS, parse_samples
from echo2p2p.hub.learning.grpo import token_logprobs
from echo2p2p.hub.learning.learner import Learner, StepStats

VOCAB = 48
PROMPT = [3, 4, 5]
COMPLETIONS = [[10, 11, 12, 1], [20, 21, 22, 23], [30, 31, 1], [40, 41, 42]]


def tiny_model(seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
    )
    return transformers.Qwen3ForCausalLM(config).float()


def sequence_logprobs(model, prompt: list[int], completions: list[list[int]]) -> list[list[float]]:
    """Per-token logprobs of each completion under `model`, one sequence at a time."""
    out = []
    with torch.no_grad():
        for c in completions:
            ids = torch.tensor([prompt + c])  # (1, T)
            mask = torch.zeros_like(ids, dtype=torch.bool)
            mask[0, len(prompt):] = True
            lp = token_logprobs(model, ids, torch.ones_like(ids), mask, 1.0)  # (1, T)
            out.append(lp[0, len(prompt):].tolist())
    return out


def make_group(model, rewards: list[float], completions=COMPLETIONS, lease: str = "l0",
               logprobs: list[list[float]] | None = None) -> ScoredGroup:
    """A group whose behaviour logprobs are `model`'s own (on-policy) unless given."""
    logprobs = logprobs or sequence_logprobs(model, PROMPT, completions)
    samples = parse_samples([  # as the hub admits them
        Sample(token_ids=pack_ids(c), logprobs=pack_logprobs(lp), text="", reward=r,
               finish_reason="stop")
        for c, lp, r in zip(completions, logprobs, rewards)
    ], VOCAB)
    assert not isinstance(samples, str), samples
    return ScoredGroup(lease_id=lease, problem_id="p0", prompt_ids=list(PROMPT), version=0,
                       samples=samples, rewards=list(rewards))


def test_step_reinforces_rewarded_completion():
    """One step raises the logprob of the rewarded completion and lowers the others'."""
    model = tiny_model()
    learner = Learner(model, lr=3e-3)
    before = [sum(lp) for lp in sequence_logprobs(model, PROMPT, COMPLETIONS)]
    stats = learner.step([make_group(model, [1.0, 0.0, 0.0, 0.0])])
    after = [sum(lp) for lp in sequence_logprobs(model, PROMPT, COMPLETIONS)]
    assert after[0] > before[0]
    assert all(a < b for a, b in zip(after[1:], before[1:]))
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-4)
    assert stats.tokens == sum(len(c) for c in COMPLETIONS)
    assert stats.groups == 1 and stats.samples == 4 and not stats.skipped


def test_learner_keeps_no_step_counter():
    """The hub's step is the run's one counter: a learner step carries no version, and a step
    with nothing to train on is still a step (stats, no update)."""
    model = tiny_model()
    learner = Learner(model, lr=1e-3)
    assert not hasattr(learner, "version")
    assert not hasattr(learner.step([make_group(model, [1.0, 0.0, 0.0, 0.0])]), "version")
    assert learner.step([]).skipped


def test_metrics_keys():
    """metrics() gives flat train/ keys with float values."""
    model = tiny_model()
    m = Learner(model, lr=1e-3).step([make_group(model, [1.0, 0.0, 0.0, 0.0])]).metrics()
    for key in ("train/policy_loss", "train/reward_mean", "train/clip_frac", "train/grad_norm",
                "train/tokens", "train/kl", "train/ratio_mean"):
        assert isinstance(m[key], float) and math.isfinite(m[key])
    assert m["train/reward_mean"] == 0.25


def hostile_samples(model) -> list[Sample]:
    """Non-finite logprobs, an out-of-vocab id, a torn id array and mismatched lengths."""
    good = sequence_logprobs(model, PROMPT, COMPLETIONS)
    nan, inf = [list(lp) for lp in good[1:3]]
    nan[2], inf[0] = float("nan"), float("-inf")
    return [
        Sample(pack_ids(COMPLETIONS[1]), pack_logprobs(nan), "", 0.0, "stop"),
        Sample(pack_ids(COMPLETIONS[2]), pack_logprobs(inf), "", 1.0, "stop"),
        Sample(pack_ids([40, VOCAB + 7, 42]), pack_logprobs(good[3]), "", 0.0, "stop"),
        Sample(pack_ids([10, 11]) + b"\x01", pack_logprobs([-1.0, -1.0]), "", 0.0, "stop"),
        Sample(pack_ids([10, 11, 12]), pack_logprobs([-1.0]), "", 0.0, "stop"),
    ]


def test_hostile_samples_never_reach_the_learner():
    """Non-finite logprobs, out-of-vocab ids and bad lengths are refused when a submission is
    parsed into rows (echo2p2p.rows, at admission), so no group holding one is ever built; a
    group the hub built wrong (out-of-vocab prompt) is dropped whole and counted, never raised."""
    model = tiny_model()
    good = make_group(model, [1.0, 0.0, 1.0, 0.0])
    first = Sample(pack_ids(COMPLETIONS[0]), pack_logprobs(
        sequence_logprobs(model, PROMPT, COMPLETIONS[:1])[0]), "", 1.0, "stop")
    reasons = [parse_samples([first, bad], VOCAB) for bad in hostile_samples(model)]
    assert reasons == [BAD_SAMPLE, BAD_SAMPLE, BAD_TOKENS, BAD_SAMPLE, BAD_SAMPLE]
    learner = Learner(model, lr=1e-3)
    bad_prompt = ScoredGroup("l2", "p2", [3, VOCAB], 0, good.samples[:2], [1.0, 0.0])
    stats = learner.step([good, bad_prompt])
    assert stats.dropped_samples == 2 and stats.dropped_groups == 1
    assert stats.samples == 4 and stats.groups == 1
    assert stats.tokens == sum(len(c) for c in COMPLETIONS)
    assert math.isfinite(stats.loss) and math.isfinite(stats.grad_norm) and not stats.skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_zero_variance_groups_counted_without_update():
    """Groups whose rewards are all equal are counted but move no weight."""
    model = tiny_model()
    learner = Learner(model, lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = learner.step([make_group(model, [1.0] * 4), make_group(model, [0.0] * 4, lease="b")])
    assert stats.groups == 2 and stats.zero_variance_groups == 2 and stats.skipped
    assert stats.tokens == 2 * sum(len(c) for c in COMPLETIONS)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_micro_batches_match_full_batch():
    """Gradient accumulation over micro-batches of 1 gives the full batch's update."""
    groups_model = tiny_model()
    groups = [make_group(groups_model, [1.0, 0.0, 0.5, 0.0]),
              make_group(groups_model, [0.0, 0.0, 0.0, 1.0], lease="b")]
    a, b = tiny_model(), tiny_model()
    sa = Learner(a, lr=1e-3, micro_tokens=1 << 20).step(groups)
    sb = Learner(b, lr=1e-3, micro_tokens=1).step(groups)
    assert sa.loss == pytest.approx(sb.loss, rel=1e-4, abs=1e-6)
    assert sa.grad_norm == pytest.approx(sb.grad_norm, rel=1e-4)
    for (k, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(pa, pb, atol=1e-5), k  # Adam: ~lr * sign(g) where g ~ 0


def test_kl_reference_is_frozen_copy():
    """With kl_coef > 0 the reference stays at version 0 and the KL becomes positive."""
    model = tiny_model()
    learner = Learner(model, lr=1e-2, kl_coef=0.1)
    ref0 = {k: v.clone() for k, v in learner.reference.state_dict().items()}
    first = learner.step([make_group(model, [1.0, 0.0, 0.0, 0.0])])
    second = learner.step([make_group(model, [1.0, 0.0, 0.0, 0.0])])
    assert first.kl == pytest.approx(0.0, abs=1e-6) and second.kl > 0
    assert all(torch.equal(ref0[k], v) for k, v in learner.reference.state_dict().items())


def test_export_weights_bf16_hf_names():
    """export_weights gives detached contiguous CPU bf16 copies under HF names."""
    model = tiny_model()
    weights = Learner(model, lr=1e-3).export_weights()
    assert "model.embed_tokens.weight" in weights
    assert "model.layers.0.self_attn.q_proj.weight" in weights
    assert "lm_head.weight" not in weights  # tied to the embedding: exported once
    for name, t in weights.items():
        assert t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()
        assert not t.requires_grad
    emb = weights["model.embed_tokens.weight"]
    emb += 1  # a copy: the master weights must not move
    assert not torch.equal(model.model.embed_tokens.weight.bfloat16(), emb)
    reloaded = tiny_model(seed=1)
    reloaded.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    assert torch.equal(reloaded.lm_head.weight, reloaded.model.embed_tokens.weight)


@dataclass(frozen=True)
class _Problem:
    id: str
    prompt: str
    answer: str
    messages: None = None  # a text prompt (`Problem.messages`)


class _CharTokenizer:
    """Just enough tokenizer for `Learner.evaluate`: one id per character, 1 is EOS."""

    eos_token_id = 1
    pad_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [2 + (ord(ch) % (VOCAB - 2)) for ch in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i < 2))


def test_evaluate_greedy_left_padded_matches_single_decoding():
    """Batched, left-padded greedy evaluation scores what one-by-one greedy decoding says."""
    model = tiny_model()
    tok = _CharTokenizer()
    problems = [_Problem(str(i), p, "") for i, p in enumerate(["1+2=", "12+34=", "7="])]
    expected = {}
    with torch.no_grad():
        for p in problems:
            ids = torch.tensor([tok.encode(p.prompt)])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=False, max_new_tokens=5, pad_token_id=0,
                                 eos_token_id=1)[0, ids.shape[1]:].tolist()
            if 1 in out:
                out = out[:out.index(1)]
            expected[p.prompt] = tok.decode(out, skip_special_tokens=True)
    seen = []

    def reward(answer: str, text: str) -> float:
        seen.append(text)
        return 1.0 if text in expected.values() else 0.0

    learner = Learner(model, lr=1e-3)
    acc = learner.evaluate(tok, problems, lambda items: [reward(p.answer, t) for p, t in items],
                           max_new_tokens=5, batch_size=2)
    assert acc == 1.0 and sorted(seen) == sorted(expected.values())
    assert model.training


def test_step_stats_is_frozen():
    """StepStats cannot be mutated after the fact."""
    model = tiny_model()
    stats = Learner(model, lr=1e-3).step([])
    assert isinstance(stats, StepStats) and stats.skipped and stats.tokens == 0
    with pytest.raises(AttributeError):
        stats.tokens = 5


def test_train_sync_smoke(tmp_path):
    """Three synchronous steps on a tiny built-in-architecture model give three finite records."""
    from bench.sync_baseline import train_sync
    from echo2p2p.policy.model import build_char_tokenizer, build_tiny_model

    # the built-in architecture with fresh weights, so the test does not need the shipped
    # echo2p2p/policy/assets
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    seen = []
    records = train_sync(model=str(tmp_path), steps=3, prompts_per_step=2, group_size=4, lr=1e-4,
                         seed=0, max_new_tokens=6, eval_every=3, eval_problems=4,
                         on_step=seen.append)
    assert [r["step"] for r in records] == [0, 1, 2] and seen == records
    assert [r["version"] for r in records] == [1, 2, 3]
    for r in records:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
        assert r["train/groups"] == 2.0 and r["train/dropped_samples"] == 0.0
        assert set(r.get("by_lag", {})) <= {"0"} and r.get("mismatch_kl", 0.0) >= 0.0  # synchronous
    assert 0.0 <= records[-1]["eval_accuracy"] <= 1.0


def test_token_budget_cuts_micro_batches_by_padded_tokens():
    """Micro-batches hold at most the budget in padded tokens (rows x the longest), longest
    first; a row over the budget goes alone; nothing is lost or repeated."""
    from echo2p2p.hub.learning.batches import Row, micro_batches

    rows = [Row(list(range(n)), 1, [0.0] * (n - 1), 1.0, i) for i, n in enumerate([3, 9, 4, 30, 5])]
    batches = micro_batches(rows, 12)
    assert [[len(r.ids) for r in b] for b in batches] == [[30], [9], [5, 4], [3]]
    assert all(len(b) * len(b[0].ids) <= 12 for b in batches if len(b) > 1)
    assert sorted(id(r) for b in batches for r in b) == sorted(id(r) for r in rows)


def test_bf16_compute_keeps_fp32_master_weights():
    """precision bf16 computes the step in bf16 (autocast) over fp32 weights: the update goes
    the same way as fp32's, the weights stay fp32."""
    groups_model = tiny_model()
    group = make_group(groups_model, [1.0, 0.0, 0.0, 0.0])
    a, b = tiny_model(), tiny_model()
    fp32 = Learner(a, lr=1e-3).step([group])
    bf16 = Learner(b, lr=1e-3, precision="bf16").step([group])
    assert all(p.dtype == torch.float32 for p in b.parameters())
    assert bf16.grad_norm == pytest.approx(fp32.grad_norm, rel=0.05)
    assert bf16.grad_norm != fp32.grad_norm  # it did compute in bf16
    before = tiny_model().state_dict()
    for k, pa in a.state_dict().items():
        da, db = pa - before[k], b.state_dict()[k] - before[k]
        if da.abs().max() > 0:
            assert torch.nn.functional.cosine_similarity(da.flatten(), db.flatten(), 0) > 0.8, k


def episode_group(model) -> tuple[ScoredGroup, list[list[bool]]]:
    """Two episodes (model turn, observation, model turn) with on-policy model logprobs, and
    the per-token masks of their model tokens."""
    from echo2p2p.episodes import model_mask, pack_turns

    episodes = [([10, 11, 1], [30, 31, 32], [12, 1]), ([20, 1], [33, 34], [21, 22, 1])]
    samples, masks = [], []
    for first, observation, second in episodes:
        ids = first + observation + second
        turns = [len(first), len(observation), len(second)]
        lp = sequence_logprobs(model, PROMPT, [ids])[0]
        mask = model_mask(turns)
        samples.append(Sample(pack_ids(ids), pack_logprobs([x for x, m in zip(lp, mask) if m]),
                              "", 0.0, "stop", pack_turns(turns)))
        masks.append(mask)
    rows = parse_samples(samples, VOCAB)
    assert not isinstance(rows, str), rows
    return ScoredGroup("e0", "p0", list(PROMPT), 0, rows, [1.0, 0.0]), masks


def reference_grad_norm(model, group: ScoredGroup, masks: list[list[bool]]) -> float:
    """The gradient norm of the batch loss with the loss taken over `masks`' tokens only."""
    from echo2p2p.hub.learning.grpo import group_advantages, policy_loss

    model.zero_grad()
    width = len(PROMPT) + max(len(m) for m in masks)
    ids = torch.zeros((2, width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros((2, width), dtype=torch.bool)
    for i, (row, m) in enumerate(zip(group.samples, masks)):
        seq = PROMPT + list(row.token_ids)
        ids[i, :len(seq)], attention[i, :len(seq)] = torch.tensor(seq), 1
        mask[i, len(PROMPT):len(seq)] = torch.tensor(m)
    logprobs = token_logprobs(model, ids, attention, mask, 1.0)
    advantages = group_advantages(torch.tensor(group.rewards))
    loss, _ = policy_loss(logprobs, logprobs.detach(), advantages, mask)
    loss.backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))


def test_episode_observation_tokens_are_masked_out_of_the_loss():
    """The learner trains an episode's model tokens only: its token count is theirs, and its
    gradient is the loss's over them, not over the observation tokens too."""
    model = tiny_model()
    group, masks = episode_group(model)
    over_model = reference_grad_norm(model, group, masks)
    over_all = reference_grad_norm(model, group, [[True] * len(m) for m in masks])
    stats = Learner(model, lr=1e-3).step([group])
    assert stats.tokens == sum(map(sum, masks)) < sum(map(len, masks))
    assert stats.grad_norm == pytest.approx(over_model, rel=1e-4)
    assert abs(over_all - over_model) > 1e-3 * over_model  # the test can tell them apart

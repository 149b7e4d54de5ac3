"""The policy loader and the rollout engines, on the real built-in model (CPU)."""

from __future__ import annotations

import pytest
import torch

from echo2p2p.policy.engines import Completion, TransformersEngine, make_engine, nucleus_logprobs
from echo2p2p.policy.model import (BUILTIN_MODEL, build_char_tokenizer, build_tiny_model, builtin_dir,
                        load_policy)

PROMPT = "47+385="


@pytest.fixture(scope="module")
def engine() -> TransformersEngine:
    return TransformersEngine(BUILTIN_MODEL)


def _prompt_ids(engine) -> list[int]:
    return engine.tokenizer.encode(PROMPT, add_special_tokens=False)


def _sample(engine, n=8, seed=0, temperature=1.0, top_p=1.0, max_new_tokens=8) -> list[Completion]:
    return engine.generate(_prompt_ids(engine), n, temperature=temperature, top_p=top_p,
                           max_new_tokens=max_new_tokens, seed=seed)


def test_char_tokenizer_round_trip():
    """The character tokenizer maps each character to one token and decodes by concatenation."""
    tok = build_char_tokenizer()
    text = "47+385=432\n (x) {y}"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    assert tok.pad_token_id != tok.eos_token_id


def test_load_builtin_policy():
    """The built-in name loads the shipped checkpoint in eval mode with pad and eos set."""
    model, tok = load_policy(BUILTIN_MODEL)
    assert (builtin_dir() / "model.safetensors").stat().st_size <= 5 * 2**20
    assert not model.training and tok.pad_token is not None and tok.eos_token is not None
    assert model.config.vocab_size == len(tok) and model.config.head_dim in (32, 64)
    assert next(model.parameters()).dtype == torch.float32


def test_load_policy_from_local_directory(tmp_path):
    """A directory written by save_pretrained loads back with the same weights."""
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=5)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = load_policy(str(tmp_path), dtype=torch.bfloat16)
    assert next(loaded.parameters()).dtype == torch.bfloat16 and len(loaded_tok) == len(tok)
    for name, param in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], param.to(torch.bfloat16)), name


def test_load_policy_unknown_name_is_clear():
    """A name that is neither built-in, a directory nor a reachable hub id fails naming it."""
    with pytest.raises(OSError, match="not-a-real/model-xyz"):
        load_policy("not-a-real/model-xyz")


def test_generate_shapes_and_logprobs(engine):
    """generate returns n completions, one logprob (<= 0) per token, EOS kept on "stop"."""
    completions = _sample(engine, n=8)
    assert len(completions) == 8
    eos = engine.tokenizer.eos_token_id
    for c in completions:
        assert len(c.token_ids) == len(c.logprobs) >= 1
        assert all(lp <= 0.0 for lp in c.logprobs)
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        else:
            assert eos not in c.token_ids and len(c.token_ids) == 8
        assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert any(c.finish_reason == "stop" for c in completions)


def test_generate_is_seeded(engine):
    """Same seed, same completions; another seed, (almost surely) other completions."""
    a, b = _sample(engine, seed=11, n=16), _sample(engine, seed=11, n=16)
    assert a == b
    assert _sample(engine, seed=12, n=16) != a


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_forward_pass(engine, temperature):
    """Reported logprobs equal log_softmax(logits / T) of a full forward pass, within 1e-4."""
    prompt = _prompt_ids(engine)
    for c in _sample(engine, n=6, seed=3, temperature=temperature):
        ids = torch.tensor([prompt + c.token_ids])  # (1, P + N)
        with torch.inference_mode():
            logits = engine.model(input_ids=ids).logits[0, len(prompt) - 1:-1]  # (N, V)
        expected = torch.log_softmax(logits / temperature, dim=-1)
        expected = expected.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4), c


def test_nucleus_logprobs_renormalise_over_top_p():
    """top_p keeps the smallest top set reaching its mass and renormalises; top_p=1 is exact."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    kept = nucleus_logprobs(logits, 1.0, 0.6).exp()
    assert torch.allclose(kept, torch.tensor([[0.625, 0.375, 0.0]]))
    assert torch.allclose(nucleus_logprobs(logits, 1.0, 1.0), torch.log_softmax(logits, -1))
    assert torch.allclose(nucleus_logprobs(logits, 1.0, 0.4).exp(), torch.tensor([[1.0, 0, 0]]))


def test_tiny_top_p_is_greedy(engine):
    """A tiny top_p samples the argmax token every time, each with logprob 0."""
    completions = _sample(engine, n=4, top_p=1e-6, seed=2)
    assert all(c.token_ids == completions[0].token_ids for c in completions)
    assert all(lp == 0.0 for c in completions for lp in c.logprobs)


def test_load_weights_bf16_changes_generations(engine):
    """A perturbed bf16 state (no tied lm_head) is copied in, cast to fp32, and changes outputs."""
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    before = _sample(engine, seed=5)
    gen = torch.Generator().manual_seed(0)
    perturbed = {k: (v + 0.05 * torch.randn(v.shape, generator=gen)).to(torch.bfloat16)
                 for k, v in original.items() if k != "lm_head.weight"}
    try:
        engine.load_weights(perturbed)
        state = engine.model.state_dict()
        assert state["model.norm.weight"].dtype == torch.float32
        assert torch.equal(state["model.norm.weight"], perturbed["model.norm.weight"].float())
        after = _sample(engine, seed=5)
        assert [c.logprobs for c in after] != [c.logprobs for c in before]
    finally:
        engine.load_weights(original)
    assert _sample(engine, seed=5) == before


def test_load_weights_rejects_bad_names(engine):
    """Unknown or missing names raise ValueError and leave the weights untouched."""
    state = dict(engine.model.state_dict())
    with pytest.raises(ValueError, match="unknown names.*not.a.weight"):
        engine.load_weights({**state, "not.a.weight": torch.zeros(1)})
    incomplete = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing names.*model.norm.weight"):
        engine.load_weights(incomplete)


def test_make_engine_unknown_kind():
    """make_engine names the engine kinds it knows."""
    with pytest.raises(ValueError, match="transformers"):
        make_engine("tensorrt", BUILTIN_MODEL, "cpu")


def test_a_half_failed_update_is_never_served():
    """A copy that fails part-way (a meta tensor last: names and shapes pass) leaves the engine
    refusing to generate until a complete state is loaded; then it samples as before."""
    engine = TransformersEngine(BUILTIN_MODEL)
    state = {k: v.clone() for k, v in engine.model.state_dict().items() if k != "lm_head.weight"}
    before = _sample(engine, n=2, seed=3)
    last = list(state)[-1]
    with pytest.raises(NotImplementedError):
        engine.load_weights({**state, last: torch.empty(state[last].shape, device="meta")})
    with pytest.raises(RuntimeError, match="failed half-way"):
        _sample(engine, n=2, seed=3)
    engine.load_weights(state)
    assert _sample(engine, n=2, seed=3) == before

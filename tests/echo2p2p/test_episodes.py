"""Multi-turn episodes on the built-in take-away game: its rules, the token layout, the hub's
replay of honest and dishonest episodes (with the real tiny tokenizer), and the shipped
tiny-takeaway checkpoint playing it."""

from __future__ import annotations

import importlib.metadata
import random

import pytest

from echo2p2p import episodes
from echo2p2p.completions import CompletionDecoder
from echo2p2p.episodes import Environment, Step
from echo2p2p.policy.model import build_char_tokenizer
from echo2p2p.tasks import TakeAway
from echo2p2p.tasks.takeaway import (MAX_PILE, MIN_PILE, legal, make, optimal_move,
                                     random_move)

TOKENIZER = build_char_tokenizer()
DECODER = CompletionDecoder(TOKENIZER)
EOS = TOKENIZER.eos_token_id


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def decode_turn(ids: list[int]) -> str | None:
    """The hub's rule: a turn's text, or None when ids follow its EOS."""
    done = DECODER.completion(ids)
    return done.text if len(done.token_ids) == len(ids) else None


def transcript(seed: int, moves) -> list[tuple[str, Step]]:
    """(action, step) of each turn of the game of `seed`; `moves(pile)` gives each action."""
    env, out = TakeAway(), []
    env.reset(seed)
    while True:
        action = moves(env.pile)
        out.append((action, step := env.step(action)))
        if step.done:
            return out


def honest(seed: int, moves) -> tuple[list[int], list[int], float]:
    """(ids, segment lengths, reward) of the game of `seed` in the episode layout: each model
    turn is its action's ids and EOS, each observation `encode(observation)`."""
    ids, lengths, reward = [], [], 0.0
    for action, step in transcript(seed, moves):
        turn = encode(action) + [EOS]
        ids += turn
        lengths.append(len(turn))
        reward += step.reward
        if not step.done:
            obs = encode(step.observation)
            ids += obs
            lengths.append(len(obs))
    return ids, lengths, reward


def optimal(pile: int) -> str:
    return str(optimal_move(pile))


def test_game_is_deterministic_given_seed_and_actions():
    """Two games of one seed with the same actions say the same things; a reused environment's
    reset starts the game afresh; the seeds' piles cover 9..21."""
    rng = random.Random(0)
    played = transcript(7, lambda pile: str(random_move(pile, rng)))
    actions = iter([a for a, _ in played])
    again = transcript(7, lambda pile: next(actions))
    assert again == played and len(played) >= 2
    env = TakeAway()
    first = env.reset(3)
    env.step("1")
    assert env.reset(3) == first == TakeAway().reset(3)
    piles = {int(TakeAway().reset(s).split()[-1].rstrip(":")) for s in range(300)}
    assert piles == set(range(MIN_PILE, MAX_PILE + 1))


def test_observations_are_short_and_say_the_pile():
    """The prompt names the pile; each observation the opponent's move and the pile left."""
    env = TakeAway()
    prompt = env.reset(11)
    pile = env.pile
    assert prompt == f"take 1-3. pile {pile}: "
    step = env.step("1")
    if not step.done:
        taken = pile - 1 - env.pile
        assert step.observation == f"I took {taken}. pile {env.pile}: " and 1 <= taken <= 3
        assert step.reward == 0.0 and len(step.observation) < 24


@pytest.mark.parametrize("action", ["4", "0", "", "x", "2 2", "-1", "1.0", "02", "two"])
def test_illegal_move_loses_at_once(action):
    """An action that is not exactly 1, 2 or 3 (stripped) ends the game with reward 0."""
    env = TakeAway()
    env.reset(5)
    pile = env.pile
    assert env.step(action) == Step("", 0.0, True) and env.pile == pile
    with pytest.raises(ValueError):
        env.step("1")  # the game is over


def test_taking_more_than_the_pile_loses_and_spaces_are_allowed():
    """Taking more stones than are left loses; whitespace around a legal move is fine."""
    assert legal(" 2\n", 2) and not legal("3", 2) and legal("1", 1) and not legal("2", 1)
    rng = random.Random(0)
    for seed in range(200):  # a game reaching a pile of 1 or 2 on the model's turn
        env = TakeAway()
        env.reset(seed)
        while not env.done and env.pile > 2:
            env.step(str(random_move(env.pile, rng)).center(3))  # " 2 ": a legal move
        if not env.done:
            assert env.step(str(env.pile + 1)) == Step("", 0.0, True)
            return
    pytest.fail("no game reached a pile of 1 or 2")


def test_last_stone_decides_the_reward():
    """Reward 1 exactly when the model takes the last stone, 0 when the opponent does."""
    won = lost = 0
    for seed in range(100):
        env = TakeAway()
        env.reset(seed)
        while True:
            move = random_move(env.pile, random.Random(seed * 31 + env.turn))
            before = env.pile
            step = env.step(str(move))
            if step.done:
                assert step.reward == (1.0 if move == before else 0.0)
                won += step.reward == 1.0
                lost += step.reward == 0.0
                break
            assert step.reward == 0.0
    assert won and lost


def test_optimal_play_wins_most_games_and_random_play_far_fewer():
    """The winning move leaves a multiple of 4; it wins most games (the opponent is beatable),
    random legal play much fewer (room to learn)."""
    assert all(optimal_move(p) in (1, 2, 3) and (p - optimal_move(p)) % 4 == 0
               for p in range(1, 30) if p % 4)
    rng = random.Random(1)
    assert all(1 <= random_move(p, rng) <= min(3, p) for p in range(1, 30) for _ in range(20))
    seeds = range(400)
    win = lambda moves: sum(transcript(s, moves)[-1][1].reward for s in seeds) / len(seeds)
    optimal_rate, random_rate = win(optimal), win(lambda p: str(random_move(p, rng)))
    assert 0.8 <= optimal_rate <= 0.95 and random_rate <= 0.3


def test_entry_point_names_the_factory():
    """The installed "echo2p2p.environments" entry point "takeaway" makes a fresh TakeAway."""
    (ep,) = importlib.metadata.entry_points(group="echo2p2p.environments", name="takeaway")
    env = ep.load()()
    assert ep.load() is make and isinstance(env, TakeAway) and isinstance(env, Environment)
    assert (env.name, env.version) == ("takeaway", "1") and env.max_turns <= episodes.MAX_TURNS


@pytest.mark.parametrize("seed", range(12))
def test_replay_accepts_an_honest_episode_and_says_its_reward(seed):
    """An episode played by the rules, laid out with the real tokenizer, replays to its reward."""
    rng = random.Random(seed)
    moves = optimal if seed % 2 else (lambda pile: str(random_move(pile, rng)))
    ids, lengths, reward = honest(seed, moves)
    packed = episodes.unpack_turns(episodes.pack_turns(lengths))
    assert packed == tuple(lengths)
    assert episodes.check_layout(packed, len(ids), sum(lengths[0::2]))
    assert episodes.replay(TakeAway(), seed, ids, lengths,
                           decode_turn=decode_turn, encode=encode) == \
        episodes.Replayed(reward)


def test_replay_says_won_and_lost_episodes_apart():
    """Among honest episodes, the replayed rewards are the games' outcomes, both 1 and 0."""
    rewards = set()
    for seed in range(40):
        ids, lengths, reward = honest(seed, optimal)
        replayed = episodes.replay(TakeAway(), seed, ids, lengths,
                                   decode_turn=decode_turn, encode=encode)
        assert replayed.fault == "" and replayed.reward == reward
        rewards.add(reward)
    assert rewards == {0.0, 1.0}


def long_episode(moves=lambda pile: "1") -> tuple[int, list[int], list[int]]:
    """A seed whose honest game of `moves` has at least three model turns, and its layout."""
    for seed in range(100):
        ids, lengths, _ = honest(seed, moves)
        if len(lengths) >= 5:
            return seed, ids, lengths
    raise AssertionError("no long game")


def test_replay_catches_an_altered_observation():
    """An observation that is not what the environment said: OBSERVATION, reward 0."""
    seed, ids, lengths = long_episode()
    at = lengths[0]  # the first observation's first id
    obs = TOKENIZER.decode(ids[at:at + lengths[1]])
    for forged in (obs.replace("took", "tooK"), obs.replace("pile ", "pile 1")):
        new = encode(forged)
        forged_ids = ids[:at] + new + ids[at + lengths[1]:]
        forged_lengths = [lengths[0], len(new), *lengths[2:]]
        assert episodes.replay(TakeAway(), seed, forged_ids, forged_lengths,
                               decode_turn=decode_turn,
                               encode=encode) == episodes.Replayed(0.0, episodes.OBSERVATION)


def test_replay_catches_an_episode_that_goes_on_after_done():
    """Turns after the environment said done: TOO_LONG."""
    seed, ids, lengths = long_episode()
    extra_obs, extra_turn = encode("I took 1. pile 3: "), encode("1") + [EOS]
    assert episodes.replay(TakeAway(), seed, ids + extra_obs + extra_turn,
                           [*lengths, len(extra_obs), len(extra_turn)], decode_turn=decode_turn,
                           encode=encode).fault == episodes.TOO_LONG
    too_many = [2, 1] * (TakeAway.max_turns) + [2]  # more model turns than max_turns
    fake = (encode("1") + [EOS] + encode(" ")) * TakeAway.max_turns + encode("1") + [EOS]
    assert episodes.replay(TakeAway(), seed, fake, too_many,
                           decode_turn=decode_turn, encode=encode).fault == \
        episodes.TOO_LONG


def test_replay_catches_an_episode_that_stops_early():
    """The last model turn and its observation cut off before the game ended: TOO_SHORT."""
    seed, ids, lengths = long_episode()
    cut = sum(lengths[-2:])
    assert episodes.replay(TakeAway(), seed, ids[:-cut], lengths[:-2], decode_turn=decode_turn,
                           encode=encode) == episodes.Replayed(0.0, episodes.TOO_SHORT)


def test_replay_catches_ids_after_eos_in_a_turn():
    """A model turn with ids after its EOS is no turn: BAD_TURNS."""
    seed, ids, lengths = long_episode()
    bad = ids[:lengths[0]] + encode("2") + ids[lengths[0]:]
    bad_lengths = [lengths[0] + 1, *lengths[1:]]
    assert decode_turn(bad[:bad_lengths[0]]) is None
    assert episodes.replay(TakeAway(), seed, bad, bad_lengths,
                           decode_turn=decode_turn, encode=encode) == \
        episodes.Replayed(0.0, episodes.BAD_TURNS)


def test_bad_layouts_are_refused():
    """Turn lengths that do not describe the ids and logprobs, or no odd run of positive
    uint32s, are refused before any replay."""
    _, ids, lengths = long_episode()
    n_model = sum(lengths[0::2])
    assert episodes.check_layout(tuple(lengths), len(ids), n_model)
    assert not episodes.check_layout(tuple(lengths), len(ids) + 1, n_model)
    assert not episodes.check_layout(tuple(lengths), len(ids), n_model - 1)
    assert not episodes.check_layout(None, len(ids), n_model)
    for bad in ([], lengths[:-1], [*lengths[:-1], 0, 2], [1] * (2 * episodes.MAX_TURNS + 1)):
        assert episodes.unpack_turns(episodes.pack_turns(bad)) is None, bad
    assert episodes.unpack_turns(episodes.pack_turns(lengths)[:-1]) is None  # not whole uint32s


def test_an_illegal_move_ends_a_replayed_episode_with_reward_0():
    """An honest episode whose model turn is illegal ends there, replayed as a loss."""
    ids = encode("9") + [EOS]
    assert episodes.replay(TakeAway(), 2, ids, [len(ids)],
                           decode_turn=decode_turn, encode=encode) == \
        episodes.Replayed(0.0)
    seed, ids, lengths = long_episode()
    turn = encode("x") + [EOS]  # the second model turn made illegal: the game ends there
    honest_ids = ids[:lengths[0] + lengths[1]] + turn
    assert episodes.replay(TakeAway(), seed, honest_ids, [lengths[0], lengths[1], len(turn)],
                           decode_turn=decode_turn, encode=encode) == episodes.Replayed(0.0)


def test_model_mask_marks_exactly_the_model_tokens():
    """The loss mask is True on each model turn's ids (the moves and their EOS) and False on
    every observation id."""
    _, ids, lengths = long_episode()
    mask = episodes.model_mask(lengths)
    assert len(mask) == len(ids) and sum(mask) == sum(lengths[0::2])
    model_ids = [i for i, m in zip(ids, mask) if m]
    assert model_ids == [tok for k in range(len(lengths) // 2 + 1) for tok in (encode("1") + [EOS])]
    observed = TOKENIZER.decode([i for i, m in zip(ids, mask) if not m])
    assert observed.startswith("I took ") and EOS not in [i for i, m in zip(ids, mask) if not m]


@pytest.fixture(scope="module")
def takeaway_engine():
    from echo2p2p.policy.engines import TransformersEngine

    return TransformersEngine("tiny-takeaway")


def engine_turns(engine, *, top_p: float, seed: int):
    """`episodes.play`'s `turns` on `engine`: one turn per context, at most 4 tokens."""
    def turns(contexts):
        out = []
        for k, context in enumerate(contexts):
            (c,) = engine.generate(context, 1, temperature=1.0, top_p=top_p, max_new_tokens=4,
                                   seed=seed * 1000 + len(context) * 10 + k)
            out.append((c.token_ids, c.logprobs, c.text, c.finish_reason == "stop"))
        return out
    return turns


def all_legal(seed: int, played: episodes.Played) -> bool:
    """Whether every model turn of `played` was a legal move."""
    env = TakeAway()
    env.reset(seed)
    for turn in episodes.split_turns(played.ids, played.turns)[0::2]:
        action = decode_turn(turn)
        if action is None or not legal(action, env.pile):
            return False
        if env.step(action).done:
            return True
    return True


def test_takeaway_base_loads_and_plays_legal_moves_greedily(takeaway_engine):
    """The shipped tiny-takeaway checkpoint loads by its built-in name and, greedy (top-p ->
    0 keeps only the top token), plays legal moves in most games, but keeps its habit (one
    stone whatever the pile) and wins far less than optimal play: room for RL."""
    from echo2p2p.policy.model import builtin_dir, load_policy

    model, tok = load_policy("tiny-takeaway")
    assert (builtin_dir("tiny-takeaway") / "model.safetensors").stat().st_size <= 5 * 2**20
    assert len(tok) == model.config.vocab_size == len(TOKENIZER)
    seeds = list(range(60))
    envs = [TakeAway() for _ in seeds]
    played = episodes.play(envs, seeds, [encode(TakeAway().reset(s)) for s in seeds],
                           engine_turns(takeaway_engine, top_p=1e-6, seed=0), encode=encode)
    legal_games = sum(all_legal(s, p) for s, p in zip(seeds, played))
    wins = sum(p.reward for p in played)
    optimal_wins = sum(transcript(s, optimal)[-1][1].reward for s in seeds)
    assert legal_games >= 0.9 * len(seeds) and wins <= 0.35 * len(seeds) < 0.7 * optimal_wins


def test_sampled_episodes_of_the_base_replay_to_their_reward(takeaway_engine):
    """Episodes sampled from the base at temperature 1 replay without a fault to the reward the
    peer saw, and it wins some games (a GRPO signal) and far fewer than optimal play."""
    seeds = list(range(100, 160))
    played = episodes.play([TakeAway() for _ in seeds], seeds,
                           [encode(TakeAway().reset(s)) for s in seeds],
                           engine_turns(takeaway_engine, top_p=1.0, seed=1), encode=encode)
    for seed, p in zip(seeds, played):
        assert episodes.check_layout(tuple(p.turns), len(p.ids), len(p.logprobs))
        assert episodes.replay(TakeAway(), seed, p.ids, p.turns,
                               decode_turn=decode_turn, encode=encode) == \
            episodes.Replayed(p.reward)
    assert 0.03 <= sum(p.reward for p in played) / len(seeds) <= 0.5

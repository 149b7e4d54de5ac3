"""Make the built-in take-away checkpoint: `python -m bench.assets.make_takeaway_base`.

Starts from the shipped tiny base (`load_policy("tiny")`) and runs a short supervised warm-up on
whole take-away episodes (echo2p2p.tasks.takeaway) laid out as the hub trains them
(echo2p2p.episodes: the prompt, then each model turn's ids and EOS, then the observation's ids,
...; loss on the model's tokens only). The warm-up player is a mixture that leaves RL room: each
move takes one stone with probability `--habit-fraction` (a habit, as the addition base's
hedged "85?"), is the winning one with probability `--optimal-fraction`, else a uniform legal
one. So the result knows the game's format and legal moves, but its most likely move is
mostly the habit: greedy play takes one stone and loses most games, sampled play wins some,
and the winning move, which it knows, is there for RL to make the likeliest. Prints the measured win rates (sampled at temperature 1, greedy, and the
pure optimal, warm-up and random players on the same games) and saves model (safetensors, fp32)
and tokenizer with save_pretrained. CPU, deterministic given --seed, a few minutes on one thread.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence

from bench.assets.make_tiny_base import supervised_steps

# Warm-up games' seeds are drawn from [WARMUP_SEED0, 2 * WARMUP_SEED0): never a seed of the hub's
# splits (echo2p2p.adapters.environment_task: held-out 0 .. eval_size - 1, then the training
# seeds).
# The win rates are measured on seeds 0, 1, ...: the hub's held-out games.
WARMUP_SEED0 = 1 << 30
MAX_TURN_TOKENS = 4  # a model turn's token cap, as a peer's: a digit and EOS need 2


def mixture_move(pile: int, rng: random.Random, optimal_fraction: float,
                 habit_fraction: float = 0.0) -> int:
    """The warm-up player's move: one stone (the habit) with probability `habit_fraction`,
    the winning move with probability `optimal_fraction`, else a uniform legal one."""
    from echo2p2p.tasks.takeaway import optimal_move, random_move

    draw = rng.random()
    if draw < habit_fraction:
        return 1
    if draw < habit_fraction + optimal_fraction:
        return optimal_move(pile)
    return random_move(pile, rng)


def episode_example(tokenizer, seed: int, choose: Callable[[int], int]
                    ) -> tuple[list[int], list[int], float]:
    """One game of `choose` (pile -> move) on the game of `seed`: its ids in the episode layout
    (prompt, model turn + EOS, observation, ...), labels that are -100 except on the model's
    tokens, and the reward."""
    from echo2p2p.tasks.takeaway import TakeAway

    env = TakeAway()
    ids = tokenizer.encode(env.reset(seed), add_special_tokens=False)
    labels = [-100] * len(ids)
    for _ in range(env.max_turns):
        turn = tokenizer.encode(str(choose(env.pile)), add_special_tokens=False)
        turn.append(tokenizer.eos_token_id)
        step = env.step(tokenizer.decode(turn, skip_special_tokens=True))
        ids += turn
        labels += turn
        if step.done:
            return ids, labels, step.reward
        obs = tokenizer.encode(step.observation, add_special_tokens=False)
        ids += obs
        labels += [-100] * len(obs)
    return ids, labels, 0.0


def policy_win_rate(seeds: Sequence[int], choose: Callable[[int], int]) -> float:
    """Share of the games of `seeds` that the pure player `choose` (pile -> move) wins."""
    from echo2p2p.tasks.takeaway import TakeAway

    wins = 0.0
    for seed in seeds:
        env = TakeAway()
        env.reset(seed)
        while not (step := env.step(str(choose(env.pile)))).done:
            pass
        wins += step.reward
    return wins / max(len(seeds), 1)


def play(model, tokenizer, seed: int, *, temperature: float | None, generator=None
         ) -> tuple[float, bool]:
    """(reward, every move legal) of the model's game of `seed`, played as a peer plays it:
    each turn is the ids sampled through EOS or MAX_TURN_TOKENS, its action their decoding,
    and each observation's ids follow it. `temperature` None: greedy."""
    import torch

    from echo2p2p.completions import CompletionDecoder
    from echo2p2p.policy.sampling import forward_cached
    from echo2p2p.tasks.takeaway import TakeAway, legal

    env, decoder = TakeAway(), CompletionDecoder(tokenizer)
    feed, cache = tokenizer.encode(env.reset(seed), add_special_tokens=False), None
    for _ in range(env.max_turns):
        turn: list[int] = []
        while len(turn) < MAX_TURN_TOKENS and tokenizer.eos_token_id not in turn:
            logits, cache = forward_cached(model, torch.tensor([feed]), cache)  # (1, V)
            if temperature is None:
                token = int(logits[0].argmax())
            else:
                probs = torch.softmax(logits[0].float() / temperature, dim=-1)  # (V,)
                token = int(torch.multinomial(probs, 1, generator=generator))
            turn.append(token)
            feed = [token]  # not in the cache yet
        action = decoder.completion(turn).text
        was_legal = legal(action, env.pile)
        step = env.step(action)
        if step.done:
            return step.reward, was_legal
        feed += tokenizer.encode(step.observation, add_special_tokens=False)
    return 0.0, True


def model_win_rate(model, tokenizer, seeds: Sequence[int], *, temperature: float | None,
                   seed: int = 0) -> tuple[float, float]:
    """(win rate, share of games with an illegal move) of the model over the games of `seeds`."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    wins = illegal = 0.0
    with torch.inference_mode():
        for s in seeds:
            reward, was_legal = play(model, tokenizer, s, temperature=temperature,
                                     generator=generator)
            wins += reward
            illegal += not was_legal
    model.train(was_training)
    return wins / max(len(seeds), 1), illegal / max(len(seeds), 1)


def warm_up(model, tokenizer, *, steps: int, batch_size: int, lr: float,
            optimal_fraction: float, habit_fraction: float, seed: int, log=print) -> float:
    """Supervised steps on the warm-up player's games; the last step's loss."""
    rng = random.Random(seed)

    def batch() -> list[tuple[list[int], list[int]]]:
        return [episode_example(tokenizer, rng.randrange(WARMUP_SEED0, 2 * WARMUP_SEED0),
                                lambda pile: mixture_move(pile, rng, optimal_fraction,
                                                          habit_fraction))[:2]
                for _ in range(batch_size)]

    loss, t0 = float("nan"), time.perf_counter()
    for step, tensor in supervised_steps(model, tokenizer.pad_token_id, batch, steps=steps, lr=lr):
        loss = tensor.item()
        if step % 50 == 0 or step == steps:
            log(f"step {step:5d}  loss {loss:.3f}  {time.perf_counter() - t0:.0f}s")
    return loss


def measure(model, tokenizer, *, episodes: int, optimal_fraction: float,
            habit_fraction: float, seed: int) -> dict[str, float]:
    """The win rates on the games of seeds 0 .. `episodes` - 1: the model's, sampled at
    temperature 1 and greedy, and the pure optimal, warm-up and random players'."""
    from echo2p2p.tasks.takeaway import optimal_move, random_move

    seeds = range(episodes)
    rng = random.Random(seed)
    sampled, sampled_illegal = model_win_rate(model, tokenizer, seeds, temperature=1.0, seed=seed)
    greedy, greedy_illegal = model_win_rate(model, tokenizer, seeds, temperature=None)
    return {
        "win_sampled_t1": sampled, "illegal_sampled_t1": sampled_illegal,
        "win_greedy": greedy, "illegal_greedy": greedy_illegal,
        "win_optimal_policy": policy_win_rate(seeds, optimal_move),
        "win_warmup_policy": policy_win_rate(
            seeds, lambda pile: mixture_move(pile, rng, optimal_fraction, habit_fraction)),
        "win_random_policy": policy_win_rate(seeds, lambda pile: random_move(pile, rng)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None,
                    help="output directory (default: echo2p2p/policy/assets/tiny-takeaway)")
    ap.add_argument("--seed", type=int, default=0, help="warm-up games, their moves, sampling")
    ap.add_argument("--optimal-fraction", type=float, default=0.3,
                    help="share of warm-up moves that are the winning one: higher, a stronger "
                         "base and less room for RL")
    ap.add_argument("--habit-fraction", type=float, default=0.4,
                    help="share of warm-up moves that take one stone whatever the pile (the "
                         "habit RL must unlearn: greedy play keeps it); the rest uniform legal")
    ap.add_argument("--steps", type=int, default=400, help="warm-up steps")
    ap.add_argument("--batch-size", type=int, default=32, help="games per warm-up step")
    ap.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    ap.add_argument("--eval-episodes", type=int, default=400, help="games each win rate is over")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)

    import torch

    from echo2p2p.policy.model import build_char_tokenizer, builtin_dir, load_policy

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = args.out or str(builtin_dir("tiny-takeaway"))
    model, tokenizer = load_policy("tiny")
    t0 = time.perf_counter()
    loss = warm_up(model, tokenizer, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                   optimal_fraction=args.optimal_fraction,
                   habit_fraction=args.habit_fraction, seed=args.seed)
    warmup_s = time.perf_counter() - t0
    rates = measure(model, tokenizer, episodes=args.eval_episodes,
                    optimal_fraction=args.optimal_fraction,
                    habit_fraction=args.habit_fraction, seed=args.seed)
    for name, value in rates.items():
        print(f"{name:22s} {value:.3f}")
    model.eval()
    model.save_pretrained(out)
    build_char_tokenizer().save_pretrained(out)  # tiny-base's files, without the loader's marks
    print(json.dumps({"out": out, "warmup_steps": args.steps, "warmup_s": round(warmup_s, 1),
                      "final_loss": round(loss, 4), "eval_episodes": args.eval_episodes,
                      **{k: round(v, 4) for k, v in rates.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

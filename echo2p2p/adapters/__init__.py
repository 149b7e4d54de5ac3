"""What other libraries wrote, plugged in as it is: environments and rewards of Gymnasium,
verifiers and TRL, and the installed environments found by entry point.

- `environments`: an environment named on the command line (an entry point of the group
  "echo2p2p.environments", `gym:...`, `verifiers:...`) found and versioned for the welcome;
- `gym_env`, `verifiers_env`: those libraries' environments given our `episodes.Environment`
  contract (each imported only when a run names one);
- `environment_task`: an environment as a task, one problem per episode seed (pure: the
  boundary test holds it to the core's rule);
- `trl_rewards`: TRL's GRPOTrainer reward functions called on a batch of one.

None of them decides anything: what an episode or a score means is the core's.
"""

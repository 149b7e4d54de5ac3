"""Environments written for other libraries, as their users write them, for the adapters' tests
(`verifiers:tests.envs.vf_sums`, `gym:tests.envs.gym_flaky:Flaky`, ...)."""

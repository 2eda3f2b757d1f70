"""The learning side: advantages and losses (GRPO, GSPO, GSPO-token, SAT, AReaL's decoupled PPO with TIS,
GMC-GRPO, k3 KL, entropy), R3 routing replay, the learner's step, the trajectory pool with its staleness
filters (none, max_age, admission, PACE), SFT warm starts, metrics, checkpoints and the sync and async
loops. Imports only `agents` (and below) of the project; names are imported from the module that
defines them (the package re-exports nothing)."""

"""The rollout side: inference engines (`pacerl.agents.engine`), the trajectory record
(`pacerl.agents.trajectory`), the multi-turn rollout driver (`pacerl.agents.rollout`), evaluation, and model
and tokenizer factories.

This package imports only `envs` (and through it `sandbox`) from the project. Import names from the
module that defines them: the package re-exports nothing, so that importing one piece never loads the
others (torch, transformers).
"""

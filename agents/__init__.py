"""The rollout side: inference engines (`agents.engine`), the trajectory record (`agents.trajectory`), the
multi-turn rollout driver (`agents.rollout`), evaluation, and model and tokenizer factories.

This package imports only `envs` (and through it `sandbox`) from the project. Import names from the
module that defines them: the package re-exports nothing, so that importing one piece never loads the
others (torch, transformers).
"""

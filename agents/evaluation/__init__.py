"""The evaluation room: everything that plays episodes to measure a model, scores them and reports.

- `config`: `EvalConfig`, how a model is evaluated (samples, sampling, budgets, what counts as correct).
- `play`: `evaluate` (a token engine through the rollout driver) and `evaluate_served` (a served
  chat-completions model), one shared skeleton, one report.
- `served`: the message-level episode player of a served model.
- `scores`: avg@k and the unbiased pass@k.
- `report`: each episode's outcome, the `EvalReport` (table and JSON) and episode transcripts.
- `benchmarks`: the named benchmarks papers report (loaders, field mappings, scoring env, sampling).
- `suites`: a suite's benchmarks evaluated one by one and laid out as papers' tables.

`pacerl eval` (the front door) builds the engine or client and the envs from the run config and calls
these; the training loop's background evaluator (`pacerl.trainer.evaluator`) schedules `evaluate` on
snapshots.
"""

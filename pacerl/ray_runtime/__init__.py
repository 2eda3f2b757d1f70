"""`runtime = "ray"`: engine replicas, environment workers and the trainer as Ray actors, under the
local runtime's own rollout driver, pool, filter and loops (docs/ray.md).

The runtime only decides where each part runs. The driver process keeps the `Run`; it sees

- an `EngineRouter` where it had an engine: least-outstanding-requests balancing over the replicas,
  every turn of one episode on the same replica (its prefix cache), and a generation lost with its
  replica sent again to another one, so the driver sees one continuous generation;
- a `RemoteEnv` where it had an env: the episode lives on an environment worker; when the worker dies
  the episode is rebuilt on another one by replaying its completed actions (or, if that fails, the
  driver plays it again from the start: `pacerl.agents.rollout.EpisodeLost`);
- a `RemoteLearner` where it had a learner: every call goes to the trainer actor, and published
  weights go from the trainer to the replicas through the object store (or a torch.distributed
  broadcast) without passing through the driver.

Dead engine replicas and environment workers are replaced by new actors (an engine loads the current
weights first) up to `ray.max_restarts` times each; every recovery is counted in the run's `faults`
(metrics `faults/*`, the summary, checkpoints) and logged in `faults.jsonl`. A dead trainer ends the
run (`TrainerLostError`) pointing at the checkpoint to resume from.

The modules, by role:

- `runtime`: `RayRuntime`, joining or starting the cluster, placing the actors, attaching to a `Run`.
- `engines`: the engine replica actor and the `EngineRouter` over the replicas.
- `learner`: the trainer actor and the `RemoteLearner` handle on it.
- `envs`: the environment worker actor and the `RemoteEnv` proxy of one episode.
- `supervisor`: bringing lost actors (replicas, workers) back, and the log of every recovery.
- `weights`: how models and weights travel between actors (recipe, published weights, broadcast).

This file imports nothing: Ray imports `pacerl.ray_runtime.envs` in every environment worker, and the
package comes first; workers must not load torch (see `envs`). Import from the modules.
"""

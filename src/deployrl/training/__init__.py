"""The training loop: `trainer` runs the steps, `rollout` samples and scores a batch with the
engine, `learner` turns it into an update (with `ps_orders`, the PS-PPO order, and `passes`, the
trainer's forward passes over micro-batches), `checkpoint` saves and resumes, `export` writes the
deployable model, `distributed` shards the work, `evaluation` scores the engine on held-out
problems and `runlog` writes what happened."""

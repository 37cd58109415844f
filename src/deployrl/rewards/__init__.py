"""Rewards: `grading` holds the pure graders and their registry (`REWARDS`, `get_reward`);
`sandbox` runs them on model output in worker processes under a time limit."""

"""Rollouts: a policy playing the environment, turned into trajectories and credited groups
(core.py, episodes, groups, step groups, credit), and the one deal runner (runner.py)."""

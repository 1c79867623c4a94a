"""What a step minimises, by ``training.train_type``: the objective contract, the supervised objectives, DPO,
GRPO, online DPO, the rollout sources, the reward functions and the frozen reference.

:mod:`.contract` declares every member the loop calls; each train type's objective is a module beside it.
"""

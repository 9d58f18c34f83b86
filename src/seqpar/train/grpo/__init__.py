"""`stage: grpo` in the plain loop: each step's rollout (generate on the SP group, score, broadcast, collate)
and the reward functions.

    rollout.py  GRPORollout (prompts -> completions -> rewards -> advantages -> SP micro-batches), grpo_step_spec
    rewards.py  the built-in rewards, resolving "module:function", scoring, group advantages
"""

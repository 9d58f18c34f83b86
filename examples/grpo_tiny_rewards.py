"""Reward for examples/grpo_tiny.yaml, found next to the config (`reward_funcs: [grpo_tiny_rewards:lowercase]`).

A tiny random-init model samples nearly uniformly over its 259 byte tokens, so about 10% of its tokens are
lowercase ASCII letters: a dense signal it can learn within a few steps (the share rises; docs/grpo.md).
"""


def lowercase(prompts, completions, completion_ids=None, **kwargs):
    """The share of the completion's tokens that are lowercase ASCII letters (byte ids 97..122), in [0, 1]."""
    return [sum(97 <= t <= 122 for t in ids) / max(1, len(ids)) for ids in completion_ids]

"""A reward for the vLLM tests: the share of a completion's token ids below 80 (half the tiny vocabulary), so the
rewards of a prompt's completions differ and every step updates the policy."""


def low_ids(prompts, completions, completion_ids=None, **_):
    return [sum(t < 80 for t in c) / max(len(c), 1) for c in completion_ids]

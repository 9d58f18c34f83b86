"""`seqpar train` on the attention variants' tiny models (gpt-oss: sinks + sliding layers; DeepSeek-V3: MLA;
Llama 4 text: NoPE temperature + chunked attention) and on RecurrentGemma's (RG-LRU blocks: conv halo and state passing,
resets at each packed document's position 0; local attention with partial rotary), windows and chunks of 16 tokens on
packed 256-token rows:
SP 2 (ring, Ulysses) equals SP 1 step by step (loss and gradient norm within 1e-5 relative, SGD, fp32). Ranks are
threads of this process (seqpar.threaded)."""

from __future__ import annotations

import pytest
from threaded_cases import compare_rows, train_rows

VARIANTS = {
    "gpt_oss": {"name": "tiny:gpt_oss", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "sliding_window": 16}},
    "deepseek_v3": {"name": "tiny:deepseek_v3", "kwargs": {"num_heads": 4, "num_kv_heads": 4, "head_dim": 16}},
    "llama4": {"name": "tiny:llama4", "kwargs": {"num_heads": 4, "num_kv_heads": 2, "sliding_window": 16}},
    "recurrent_gemma": {"name": "tiny:recurrent_gemma"},  # (its window: attention_window_size 16, tiny_config's)
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_train_sp2_equals_sp1(tmp_path, name):
    model = VARIANTS[name]
    want = train_rows(tmp_path / "sp1", model, 1, 1, steps=2, checkpoint_every=0)
    for u, r in ((1, 2), (2, 1)):
        compare_rows(train_rows(tmp_path / f"u{u}r{r}", model, u, r, steps=2, checkpoint_every=0), want, 1e-5)

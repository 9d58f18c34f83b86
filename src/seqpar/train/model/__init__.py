"""Loading the model and tokenizer a run names, checking them against the run, and building the model a
step trains (seqpar.hf.prepare_model, then FSDP2 or bf16 masters; the reference model).

    load.py        model_info (the model's config, read once per run) / load_model / load_tokenizer (tiny:<arch>,
                   smollm2, a local HF directory)
    tokenizers.py  ByteTokenizer (tiny models), HFTokenizer (a transformers tokenizer + chat template)
    checks.py      check_model: causal LM, vocabulary and positions vs the dataset (before launch)
    build.py       build_model (prepare_model + this run's wrapper), build_reference, apply_fsdp, shard_reference
    precision.py   MasterWeights: fp32 masters behind a bf16 model without FSDP
"""

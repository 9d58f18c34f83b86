"""Loading the model and tokenizer a run names, checking them against the run, and building the model a
step trains (SP attention, LoRA, memory features, FSDP2, bf16 masters, the reference model).

    load.py        load_model / load_tokenizer / model_config (tiny:<arch>, smollm2, a local HF directory)
    tokenizers.py  ByteTokenizer (tiny models), HFTokenizer (a transformers tokenizer + chat template)
    checks.py      check_model: causal LM, vocabulary and positions vs the dataset (before launch)
    build.py       build_model, build_reference, apply_fsdp, the memory features
    precision.py   MasterWeights: fp32 masters behind a bf16 model without FSDP
"""

"""Dataset ingestion: local files -> rows -> normalised formats -> token ids + labels -> packed examples,
then streams of row indices and the collator that shards them for this rank.

    tokenize.py  load_rows, tokenize_sft / tokenize_dpo, pack_rows, build_examples, describe_stats
    formats.py   row formats (Alpaca, ShareGPT, TRL messages / prompt-completion / preference, text, tokenized)
    images.py    chat rows with local images for vision-language models, VisionCollator
    prompts.py   GRPO prompt rows
    prepare.py   prepare_examples: the run's dataset as examples + truncation / drop counts
    streams.py   DataStream (resumable row indices per dp slot), build_data, make_collator
"""

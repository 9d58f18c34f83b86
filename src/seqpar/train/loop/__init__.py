"""The training loop's parts: what one step does and what it logs.

    state.py       Loop (everything one rank's loop holds), TrainResult
    build.py       build_loop: model, optimizer, data streams, step spec for one rank
    step.py        train_step (micro-batches -> global loss -> summed gradients -> clip -> update), measured_step
    optim.py       the optimizer and learning-rate schedule
    evaluation.py  the SP eval loss over a fixed eval set (every row counted once)
    metrics.py     metrics.jsonl rows, TensorBoard, the data pipeline's counts
    plots.py       loss.png from metrics.jsonl
    grads.py       gradient dumps and comparisons for `seqpar verify`
"""

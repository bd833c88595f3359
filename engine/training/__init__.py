"""The shared leaves of training, what every strategy and technique reads alike:

- data.py: data sets (token files memory-mapped, text, digits) and the pure (step, seed) -> indices rule;
- token_scan.py: a token file's largest id, scanned once and kept beside it;
- loss.py: the loss, and each share's weight in the global batch's mean (share_loss, every strategy's);
- optim.py: optimizer kernels and the warmup-cosine learning-rate schedule;
- precision.py: which dtype each tensor has (compute, working weights, reductions);
- timing.py: the device's clock (CUDA events on a GPU, the host's on the CPU).

Imports engine.config and each other (data -> loss -> precision, data -> token_scan); nothing above.
"""

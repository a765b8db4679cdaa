"""The GPU check: one command that proves and measures every CUDA path of mtpkit, for the day a GPU is lent.

    pip install -e .[kernels]                       # flash-linear-attention (and causal-conv1d where it builds)
    python -m mtpkit.bench.gpu_check --out DIR       # under 8 minutes on one H200
    python -m mtpkit.bench.gpu_check --out DIR --device cpu --tiny   # the same code on a CPU in seconds (CI)

1. correctness.py, kernels.py: logits of Qwen3.5 (dense, MoE), Qwen3-Next and Qwen3-VL against transformers on
   the device in fp32 and bf16; packed documents; speculative == plain decoding; the fla and causal-conv1d
   kernels against pure-torch references (values, states, gradients, cu_seqlens).
2. decoding.py: Qwen3.5-0.8B/2B-shaped random models in bf16: plain and speculative tokens/s, step costs,
   verify/decode ratios, memory bandwidth, transformers' generate() on the same weights.
3. training.py, train_worker.py: FSDP2 through torchrun at those shapes, seq 4096: tokens/s, MFU, peak memory,
   compile and activation checkpointing on/off, MTP on/off.
Prints a report (report.py) and writes DIR/gpu_check.json; exits 1 when a correctness check fails.
"""

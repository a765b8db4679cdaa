"""Benchmarks, not library code. `mtpkit bench` (cli/bench_cmd.py over speedup.py, acceptance.py, contexts.py,
report.py) is the one users run; the measurement tools behind the design note's figures (docs/MTP.md) are modules
run the same way, each with `--help`, printing its tables:

    python -m mtpkit.bench.decode_step     step costs vs memory bandwidth per dtype, routing table, vs transformers
    python -m mtpkit.bench.head_ranks      how often the trunk's token is in the head's top c, per depth
    python -m mtpkit.bench.head_step       MTP-head training step: online (trunk re-run) vs stored features
    python -m mtpkit.bench.quality         greedy agreement and perplexity of fp32, bf16 and int8 weights
    python -m mtpkit.bench.train_memory    training step time and peak memory, MTP on vs off
    python -m mtpkit.bench.gpu_check       on a GPU: correctness, decoding and training figures

They share only timing.py (and models.presets' shapes); none imports another's internals.
"""

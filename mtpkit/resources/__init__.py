"""Data shipped with mtpkit: the benchmark prompts and the trained SmolLM2-135M-Instruct MTP head."""

"""Data shipped with mtpkit: the benchmark prompts, the held-out document-chat prompts
(`datasets.doc_chat_heldout`) and the trained SmolLM2-135M-Instruct MTP head."""

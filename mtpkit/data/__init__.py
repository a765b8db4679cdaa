"""Training data: files read, tokenized and packed into rows with segment ids; image records; cached features."""

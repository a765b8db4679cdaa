"""The data sets mtpkit makes: Shakespeare and its tokenizer, the shapes image-caption set, self-distillation data
and cached trunk features."""

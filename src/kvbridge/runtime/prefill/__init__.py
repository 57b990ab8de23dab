"""The prefill half: the sending request, its role, the writer and its staged path."""

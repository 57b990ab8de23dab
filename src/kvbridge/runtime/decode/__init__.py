"""The decode half: the receiving request, its role, the link to prefill ranks, and the
staged landing."""

"""Benchmarks behind ``kvbridge bench``. Every figure is measured in the run that prints it."""

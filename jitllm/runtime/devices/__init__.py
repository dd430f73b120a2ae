"""Devices the executor runs blocks on: the host and accelerators, one small module per backend."""

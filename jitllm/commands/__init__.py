"""One module per CLI verb; each defines one click command."""

"""The engine: a model's units on their devices, sessions, and the steps and moves that run them (the
executor.py facade; one module per job beside it, docs/architecture.md)."""

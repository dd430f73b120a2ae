"""Devices, placement, KV pages, execution and migration."""

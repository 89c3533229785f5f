"""Transports move bytes between registered memory of two workers."""

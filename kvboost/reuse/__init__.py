"""Reuse of cached KV in a request: assembly of a lookup's plan into a block table, and content repair."""
